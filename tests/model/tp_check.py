"""Run in a child process (it needs 2 CPU devices before JAX starts): the forward with weights and pool
sharded over a 2-way "tensor" mesh axis by logical-axis rules equals the unsharded forward."""

import jax

jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sgjax.kernels import allocate_pool, ref_attention  # noqa: E402
from sgjax.model.batch import build_batch  # noqa: E402
from sgjax.model.presets import TINY_QWEN2  # noqa: E402
from sgjax.model.weights import dummy_weights, shardings  # noqa: E402
from tests.model.steps import make_step  # noqa: E402

RULES = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"}


def main():
    assert len(jax.devices()) == 2
    cfg = TINY_QWEN2
    weights = dummy_weights(cfg, seed=1)
    batch = jax.tree.map(jnp.asarray, build_batch([[1, 2, 3, 4, 5], [7, 8]], [5, 2], [[1, 2], [3]], 4, 16, 4, 2))
    step = make_step(cfg, ref_attention)
    pool = allocate_pool(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim)
    expected, _ = step(weights, pool, batch)

    mesh = Mesh(np.array(jax.devices()), ("tensor",))
    sharded_weights = jax.device_put(weights, shardings(weights, mesh, RULES))
    # The pool splits on its interleaved (K, V) head axis: device i holds K and V of KV head i.
    pool_sharding = NamedSharding(mesh, P(None, None, None, "tensor", None))
    pool = allocate_pool(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, sharding=pool_sharding)
    logits, pool = step(sharded_weights, pool, batch)
    assert sharded_weights.layers.wq.sharding.spec == P(None, None, "tensor")
    assert pool.sharding.is_equivalent_to(pool_sharding, pool.ndim), pool.sharding
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5, rtol=1e-5)
    print("tensor-parallel forward OK")


if __name__ == "__main__":
    main()
