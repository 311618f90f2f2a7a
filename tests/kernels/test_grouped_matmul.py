"""The Pallas grouped matmul (kernels/grouped_matmul_gpu.py) against per-group numpy products, and model/moe.experts
on it against ragged_dot. On CPU the kernel runs in Pallas interpret mode; on a GPU the same tests run it compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import grouped_matmul_gpu as gmm
from sgjax.model.moe import _pallas_fits, experts

INTERPRET = jax.default_backend() != "gpu"
# group sizes with empty groups, a group longer than a tile, sizes off the tile, rows after the last group
SIZES = {"ragged": [7, 0, 20, 1, 3, 0], "one-group": [0, 0, 37, 0], "all-empty": [0, 0, 0]}


def _reference(x, w, sizes):
    out, start = np.zeros((x.shape[0], w.shape[2]), np.float64), 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n].astype(np.float64) @ w[g].astype(np.float64)
        start += n
    return out, start


@pytest.mark.parametrize("num_rows,block_m", [(40, 16), (33, 32), (64, 128)])
def test_tile_table_covers_each_group_row_once(num_rows, block_m):
    rng = np.random.default_rng(num_rows)
    for _ in range(20):
        sizes = rng.multinomial(rng.integers(0, num_rows + 1), np.ones(6) / 6) * (rng.random(6) < 0.7)
        tiles = np.asarray(gmm.tile_table(jnp.asarray(sizes, jnp.int32), num_rows, block_m))
        assert len(tiles) == -(-num_rows // block_m) + min(6, num_rows)
        owner = np.full(num_rows, -1)
        for g, start, end in tiles:
            assert 0 <= end - start <= block_m
            assert (owner[start:end] == -1).all()  # no row in two tiles
            owner[start:end] = g
        ends = np.cumsum(sizes)
        expected = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)] + [np.full(num_rows - ends[-1], -1)])
        np.testing.assert_array_equal(owner, expected)  # every group's rows in tiles of that group only


@pytest.mark.parametrize("sizes", sorted(SIZES))
@pytest.mark.parametrize("config", [None, dict(block_m=32, block_n=64, block_k=32)], ids=["default", "m32"])
def test_grouped_matmul_matches_per_group_products(sizes, config):
    sizes = SIZES[sizes]
    rng = np.random.default_rng(len(sizes))
    x = rng.standard_normal((sum(sizes) + 5, 64)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 64, 128)).astype(np.float32)
    out = np.asarray(
        gmm.grouped_matmul(
            jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32), interpret=INTERPRET, config=config
        )
    )
    expected, n = _reference(x, w, sizes)
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out[:n], expected[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gate_up_fuses_the_activation(activation):
    sizes = SIZES["ragged"]
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((sum(sizes) + 3, 64)), jnp.bfloat16)
    wg, wu = (jnp.asarray(rng.standard_normal((len(sizes), 64, 128)) / 8, jnp.bfloat16) for _ in range(2))
    out = gmm.gate_up(x, wg, wu, jnp.asarray(sizes, jnp.int32), activation=activation, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    f32 = [np.asarray(a, np.float32) for a in (x, wg, wu)]
    gate, n = _reference(f32[0], f32[1], sizes)
    up, _ = _reference(f32[0], f32[2], sizes)
    act = (jax.nn.silu if activation == "silu" else lambda a: jax.nn.gelu(a, approximate=True))(gate)
    np.testing.assert_allclose(np.asarray(out, np.float32)[:n], np.asarray(act * up)[:n], rtol=2e-2, atol=2e-2)


def test_blocks_shrink_to_small_experts_and_must_divide():
    assert gmm.fit(dict(block_k=64, block_n=128), 32, 64) == dict(block_k=32, block_n=64)
    assert gmm.supported(64, 128, gmm.default_config(8, 4, jnp.float32))
    assert not gmm.supported(64, 96, dict(block_k=32, block_n=64))
    with pytest.raises(ValueError, match="must divide"):
        gmm.grouped_matmul(
            jnp.zeros((4, 64)), jnp.zeros((2, 64, 96)), jnp.asarray([2, 2]), interpret=True, config=dict(block_n=64)
        )
    sizes = jnp.asarray([2, 2])
    with pytest.raises(ValueError, match="another block_m"):  # a shared tile table must match the kernel's tiles
        gmm.grouped_matmul(
            jnp.zeros((40, 64)),
            jnp.zeros((2, 64, 64)),
            sizes,
            interpret=True,
            config=dict(block_m=32),
            tiles=gmm.tile_table(sizes, 40, 16),
        )


@pytest.mark.parametrize("first,here", [(0, 6), (2, 3)], ids=["all-experts", "expert-shard"])
def test_experts_on_the_kernel_match_ragged_dot(first, here):
    """model/moe.experts with kernel="pallas" (an expert-parallel shard too: the pairs routed to other devices'
    experts sort last, outside every group) equals the ragged_dot path."""
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.standard_normal((11, 64)), jnp.float32)
    top_i = jnp.asarray(rng.choice([0, 2, 3, 5], size=(11, 2)), jnp.int32)
    top_w = jnp.asarray(rng.random((11, 2)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((here, 64, 128)) / 8, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((here, 128, 64)) / 8, jnp.float32)
    args = (h, top_w, top_i, wg, wu, wd)
    assert _pallas_fits(h, wg, wd)  # the kernel, not the ragged_dot fallback
    with jax.default_matmul_precision("highest"):  # as the forward runs float32 (XLA's GPU default is TF32)
        want = experts(*args, first=first, kernel="xla")
        got = experts(*args, first=first, kernel="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="moe kernel"):
        experts(*args, kernel="triton")
