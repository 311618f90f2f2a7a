"""The Pallas KV write (kernels/kv_write_gpu.py) against kv_pool.write_kv, in interpret mode on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels.kv_pool import write_kv
from sgjax.kernels.kv_write_gpu import pallas_write_kv
from tests.kernels.test_pallas_attention import HEADS, _check

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize(
    "layers,pages,page_size,kv_heads,head_dim,tokens,dtype",
    [
        (2, 9, 16, 3, 64, 37, jnp.float32),  # SmolLM2's 3 KV heads: 192 columns, masked up to 256
        (3, 17, 8, 8, 128, 5, jnp.bfloat16),  # Llama-3-8B's heads, a decode-sized batch, page 8
        (2, 40, 16, 2, 64, 300, jnp.float32),  # more tokens than one program's block, with a remainder
    ],
)
@pytest.mark.parametrize("by_head", [False, True], ids=["flat", "by-head"])
def test_matches_xla_scatter(layers, pages, page_size, kv_heads, head_dim, tokens, dtype, by_head):
    keys = jax.random.split(jax.random.key(tokens), 3)
    pool = jax.random.normal(keys[0], (layers, pages, page_size, 2 * kv_heads, head_dim), dtype)
    k, v = (jax.random.normal(key, (tokens, kv_heads, head_dim), dtype) for key in keys[1:])
    slots = np.random.default_rng(tokens).permutation(np.arange(page_size, pages * page_size))[:tokens]
    slots[-2:] = 0  # padded rows point at the null page (page 0)
    slots = jnp.asarray(slots, jnp.int32)
    expected = np.array(write_kv(pool, jnp.int32(1), k, v, slots), np.float32)
    write = jax.jit(pallas_write_kv, static_argnames=("interpret", "by_head"))
    got = np.array(write(pool, jnp.int32(1), k, v, slots, interpret=INTERPRET, by_head=by_head), np.float32)
    expected[1, 0] = got[1, 0] = 0  # the null page: the padded rows race there by design
    np.testing.assert_array_equal(got, expected)


def test_fp32_pool_takes_bf16_tokens():
    pool = jnp.zeros((1, 3, 8, 4, 64), jnp.float32)
    k = jnp.full((2, 2, 64), 1.5, jnp.bfloat16)
    out = pallas_write_kv(pool, jnp.int32(0), k, -k, jnp.asarray([9, 10], jnp.int32), interpret=INTERPRET)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out[0, 1, 1:3, 0::2]), 1.5)
    np.testing.assert_array_equal(np.asarray(out[0, 1, 1:3, 1::2]), -1.5)
    assert float(jnp.abs(out).sum()) == 2 * 2 * 2 * 64 * 1.5


@pytest.mark.parametrize("case", ["mixed", "page-crossing"])
def test_attention_with_pallas_write(case):
    _check(case, HEADS["gqa4"], kv_write="pallas")


def test_unknown_kv_write_is_named():
    with pytest.raises(ValueError, match="kv_write"):
        _check("mixed", HEADS["gqa4"], kv_write="triton")
