"""The paged KV pool layout, shared by every attention backend and the tests.

pool: dtype[num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim]; K of head h at combined
index 2h and V at 2h + 1, so one page of one layer holds both K and V of all heads contiguously
(the layout of TPU ragged paged attention; GPU kernels read it by stride). Page 0 is the null page.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = Any


def pool_shape(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    return (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)


def allocate_pool(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32, sharding=None
) -> Array:
    """A zero-initialised pool (never jnp.empty: 0 * NaN from an unwritten page would poison outputs)."""
    shape = pool_shape(num_layers, num_pages, page_size, num_kv_heads, head_dim)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def interleave_kv(k: Array, v: Array) -> Array:
    """[T, Hkv, D] K and V -> [T, 2*Hkv, D] in the pool's K/V-interleaved head order."""
    t, h, d = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * h, d)


def split_kv(kv: Array) -> tuple[Array, Array]:
    """[..., 2*Hkv, D] -> K and V, each [..., Hkv, D]."""
    return kv[..., 0::2, :], kv[..., 1::2, :]


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_pool(x: Array, dtype) -> Array:
    """x stored as the pool's dtype. An fp8 pool saturates at its largest finite value: a plain cast gives NaN (e4m3fn)
    or inf past it, which one outlier key would spread through every later score. No scale (1.0, as SGLang and vLLM
    use when the checkpoint gives none). The cpu kernel writes the same bytes itself (cpu_attention.cc: ToFp8)."""
    if is_fp8(dtype):
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def read_pool(x: Array, dtype) -> Array:
    """Keys or values read from the pool, widened to `dtype` (the queries') when the pool is fp8; others as stored
    (a bf16 pool under float32 queries keeps its dtype: the backends' dots widen it)."""
    return x.astype(dtype) if is_fp8(x.dtype) else x


def write_kv(pool: Array, layer: Array, k: Array, v: Array, slot_mapping: Array) -> Array:
    """Scatter the new tokens' K/V into `layer` of the pool (in place when the pool is donated)."""
    page_size = pool.shape[2]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    return pool.at[layer, pages, offsets].set(to_pool(interleave_kv(k, v), pool.dtype))
