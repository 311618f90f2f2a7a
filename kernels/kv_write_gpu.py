"""The new tokens' K/V into the paged pool, as a Pallas-Triton kernel (the GPU backend's KV write).

XLA's scatter (kv_pool.write_kv) took about 2.5 times this kernel's time for a long prefill on the H200
(docs/journal/kernels-h200.md); decode batches are too small to tell them apart. It writes the pool in place
(input_output_aliases), one program per block of tokens: each token's K and V of every head land in
its slot's row of the pool viewed as [layers * pages * page_size, 2 * Hkv * D], K of head h at
columns [2hD, 2hD + D) and V right after (kv_pool's interleaved layout), one contiguous run per head.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sgjax.kernels.kv_pool import to_pool

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # jax 0.11 deprecates the Triton backend
    from jax.experimental.pallas import triton as plgpu

_ELEMENTS_PER_PROGRAM = 8192  # tokens x columns per program: a few loads in flight per warp, many programs


def _kernel(
    slot_ref, layer_ref, k_ref, v_ref, _pool_in, pool_ref, *, block_t, cols, num_tokens, head_dim, slots_per_layer
):
    t = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    c = jnp.arange(pl.next_power_of_2(cols), dtype=jnp.int32)  # Triton blocks are powers of two: mask the rest
    ok = (t < num_tokens)[:, None] & (c < cols)[None, :]
    row = layer_ref[0] * slots_per_layer + plgpu.load(slot_ref.at[t], mask=t < num_tokens, other=0)
    k_col = (c // head_dim) * (2 * head_dim) + c % head_dim  # K of head h at combined index 2h
    for src, col in ((k_ref, k_col), (v_ref, k_col + head_dim)):
        x = plgpu.load(src.at[t[:, None], c[None, :]], mask=ok, other=0)
        plgpu.store(pool_ref.at[row[:, None], col[None, :]], to_pool(x, pool_ref.dtype), mask=ok)


def _kernel_by_head(
    slot_ref, layer_ref, k_ref, v_ref, _pool_in, pool_ref, *, block_t, num_tokens, num_kv_heads, slots_per_layer
):
    # [tokens, heads, head_dim] blocks: the last index is a plain arange, so Triton can see each head's run is
    # contiguous and store it in wide vectors (the flat kernel's column arithmetic may hide that).
    t = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    h = jnp.arange(pl.next_power_of_2(num_kv_heads), dtype=jnp.int32)
    d = jnp.arange(k_ref.shape[-1], dtype=jnp.int32)
    ok = ((t < num_tokens)[:, None] & (h < num_kv_heads)[None, :])[:, :, None]
    row = layer_ref[0] * slots_per_layer + plgpu.load(slot_ref.at[t], mask=t < num_tokens, other=0)
    idx = (t[:, None, None], h[None, :, None], d[None, None, :])
    for src, part in ((k_ref, 0), (v_ref, 1)):
        x = plgpu.load(src.at[idx], mask=ok, other=0)
        plgpu.store(
            pool_ref.at[row[:, None, None], (2 * h + part)[None, :, None], d[None, None, :]],
            to_pool(x, pool_ref.dtype),
            mask=ok,
        )


def pallas_write_kv(
    pool,
    layer,
    k,
    v,
    slot_mapping,
    *,
    interpret: bool = False,
    elements_per_program: int = _ELEMENTS_PER_PROGRAM,
    num_warps: int = 4,
    by_head: bool = True,
):
    """kv_pool.write_kv's contract (pool [L, P, S, 2 Hkv, D]; k, v [T, Hkv, D]; slots into `layer`),
    updating the pool in place when it is donated. Padded rows point at the null page, so several
    programs may write it: its contents are never read unmasked, whichever write lands. `by_head` (the default)
    moves [tokens, heads, D] blocks, the flat kernel [tokens, heads * D]: the first was the faster on prefill and
    mixed steps alike (docs/journal/kernels-h200.md)."""
    num_layers, num_pages, page_size, num_combined, head_dim = pool.shape
    num_tokens, num_kv_heads, _ = k.shape
    if num_tokens == 0:
        return pool
    cols = num_kv_heads * head_dim
    block_t = max(1, min(pl.next_power_of_2(num_tokens), elements_per_program // pl.next_power_of_2(cols)))
    if by_head:
        kernel = functools.partial(
            _kernel_by_head,
            block_t=block_t,
            num_tokens=num_tokens,
            num_kv_heads=num_kv_heads,
            slots_per_layer=num_pages * page_size,
        )
        flat = pool.reshape(num_layers * num_pages * page_size, num_combined, head_dim)
        k, v = k.reshape(num_tokens, num_kv_heads, head_dim), v.reshape(num_tokens, num_kv_heads, head_dim)
    else:
        kernel = functools.partial(
            _kernel,
            block_t=block_t,
            cols=cols,
            num_tokens=num_tokens,
            head_dim=head_dim,
            slots_per_layer=num_pages * page_size,
        )
        flat = pool.reshape(num_layers * num_pages * page_size, num_combined * head_dim)
        k, v = k.reshape(num_tokens, cols), v.reshape(num_tokens, cols)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t),),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        input_output_aliases={4: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="paged_kv_write",
    )(slot_mapping.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32), k, v, flat)
    return out.reshape(pool.shape)
