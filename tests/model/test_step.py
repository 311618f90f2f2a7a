"""The jitted step: one compile per shape bucket, the pool donated, sharding, and bad inputs named clearly."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import allocate_pool, ref_attention
from sgjax.model.batch import BatchShape, build_batch, pack, unpack
from sgjax.model.llama import forward
from sgjax.model.presets import TINY_LLAMA as CFG
from sgjax.model.weights import dummy_weights
from tests.model.steps import make_packed_step, make_step


def test_twenty_ragged_steps_in_one_bucket_compile_once():
    @chex.assert_max_traces(n=1)
    def traced(weights, pool, batch):
        return forward(weights, pool, batch, cfg=CFG, attention=ref_attention)

    step = jax.jit(traced, donate_argnames=("pool",))
    weights = dummy_weights(CFG)
    pool = allocate_pool(CFG.num_layers, 33, 4, CFG.num_kv_heads, CFG.head_dim)
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 5))
        lens = [int(x) for x in rng.integers(1, 6, size=n)]
        ctx = [int(x) for x in rng.integers(0, 8, size=n)]
        pages = rng.permutation(np.arange(1, 33))[: n * 4].reshape(n, 4)
        batch = build_batch(
            [list(rng.integers(0, 128, size=q)) for q in lens],
            [c + q for c, q in zip(ctx, lens)],
            [list(p) for p in pages],
            4,
            32,
            4,
            4,
        )
        old = pool
        logits, pool = step(weights, pool, jax.tree.map(jnp.asarray, batch))
        assert old.is_deleted()  # donated: updated in place, never copied
        assert np.isfinite(np.asarray(logits)).all()
    assert step._cache_size() == 1


def test_bucket_overflow_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the bucket"):
        build_batch([[1] * 20, [2] * 20], [20, 20], [[1] * 8, [2] * 8], 4, 32, 4, 8)
    with pytest.raises(ValueError, match="pages cannot hold"):
        build_batch([[1] * 9], [9], [[1, 2]], 4, 16, 4, 4)


def test_tensor_parallel_sharding_by_logical_axes():
    """Weights and pool sharded over 2 CPU devices by the logical-axis rules give the same logits."""
    script = os.path.join(os.path.dirname(__file__), "tp_check.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor-parallel forward OK" in done.stdout


def test_packed_batch_is_one_transfer_with_the_same_result():
    rng = np.random.default_rng(1)
    batch = build_batch(
        [list(rng.integers(0, 128, size=n)) for n in (3, 1, 6)], [5, 9, 6], [[1, 2], [3, 4, 5], [6, 7]], 4, 16, 4, 4
    )
    shape = BatchShape.of(batch)
    buffer = pack(batch)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    jax.tree.map(np.testing.assert_array_equal, unpack(buffer, shape), batch)
    weights = dummy_weights(CFG)
    new_pool = lambda: allocate_pool(CFG.num_layers, 9, 4, CFG.num_kv_heads, CFG.head_dim)  # noqa: E731
    expected, expected_pool = make_step(CFG, ref_attention)(weights, new_pool(), jax.tree.map(jnp.asarray, batch))
    step = make_packed_step(CFG, ref_attention)
    logits, pool = step(weights, new_pool(), jnp.asarray(buffer), shape)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(expected_pool))


@pytest.mark.parametrize("dtype,precision", [("float32", "HIGHEST"), ("bfloat16", None)])
def test_float32_dots_are_float32(dtype, precision):
    # A GPU runs default-precision fp32 dots as TF32; an fp32 model must ask for full precision in its program.
    cfg = CFG.replace(dtype=dtype)
    weights = dummy_weights(cfg)
    pool = allocate_pool(cfg.num_layers, 9, 4, cfg.num_kv_heads, cfg.head_dim, dtype=jnp.dtype(dtype))
    batch = jax.tree.map(jnp.asarray, build_batch([[1, 2, 3]], [3], [[1, 2]], 4, 8, 2, 2))
    text = make_step(cfg, ref_attention).lower(weights, pool, batch).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= 8  # q, k, v, o, gate, up, down, logits
    for line in dots:
        assert (f"precision = [{precision}, {precision}]" in line) == bool(precision), line
