"""Our own ragged paged attention for TPU in Pallas-Mosaic (installed as sgjax.kernels.pallas_tpu_kernel).

Why a second TPU kernel beside jax's `ragged_paged_attention`: that one is tuned on real TPUs, but it cannot run
in TPU interpret mode (its in-kernel `ref.reshape` fails there on jax 0.10 and 0.11), so without a TPU its
numbers were never executed. This one uses only what interpret mode runs (scalar prefetch, manual DMAs with
semaphores, plain value ops), so CI executes the TPU code path on CPU, and it shares the GPU kernel's
structure:

- Grid (query block, KV head). A query block is `block_q` rows of one request (kernels.ragged_blocks, the
  GPU kernel's table, here in SMEM by scalar prefetch); the G query heads of the KV head are packed with the
  block's rows into the G * block_q rows of each dot, so each K/V tile is fetched once per group.
- q is laid out [Hkv, G, T + block_q, D] by the wrapper, so a program's rows are one strided DMA (the
  block_q rows of padding keep the last block's DMA in bounds); merging (G, block_q) into one dot dimension
  is a leading-dim reshape, which Mosaic accepts when block_q is a multiple of the sublane tile.
- The pool is viewed as [L * pages * page_size, 2 * Hkv * D] (a bitcast, as on GPU); a page of head h is
  page_size rows of D elements at column 2hD (K) and (2h + 1)D (V): one strided DMA each. `pages_per_block`
  pages make a key tile; tiles are double-buffered (the next tile's DMAs start before this tile's dots).
- Online softmax in fp32. Each program writes its whole [G, block_q, D] output block (no races: blocks are
  disjoint), and the wrapper gathers each row from its owner block (rows past a request's end are dropped).
  The padding rows past cu_q_lens[-1] belong to a pseudo-request with no keys, so they come out as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgjax.kernels import ragged_blocks as rb
from sgjax.kernels.kv_pool import read_pool, write_kv
from sgjax.kernels.metadata import AttentionMetadata

_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so a fully masked row never makes inf - inf


def _kernel(
    blk_ref,
    kv_lens_ref,
    pt_ref,
    layer_ref,
    q_hbm,
    kv_hbm,
    o_ref,
    q_buf,
    k_buf,
    v_buf,
    sems,
    *,
    block_q,
    group,
    head_dim,
    page_size,
    pages_per_block,
    pages_per_req,
    pages_per_layer,
    scale,
    softcap,
):
    b, h = pl.program_id(0), pl.program_id(1)
    f = rb.NUM_FIELDS
    row_start, row_end = blk_ref[b * f + rb.ROW_START], blk_ref[b * f + rb.ROW_END]
    pos_offset, req = blk_ref[b * f + rb.POS_OFFSET], blk_ref[b * f + rb.REQUEST]
    rows = jnp.minimum(row_end - row_start, block_q)
    # Keys up to the block's last row (causal) and never past the request's length.
    num_keys = jnp.where(rows > 0, jnp.minimum(kv_lens_ref[req], row_start + rows + pos_offset), 0)
    block_k = pages_per_block * page_size
    num_tiles = (num_keys + block_k - 1) // block_k
    layer_base = layer_ref[0] * pages_per_layer
    window = layer_ref[1]  # 0: none; else a row at p sees keys (p - window, p]
    # the first tile any row of the block can see: the window's lower edge for the block's first row
    first_tile = jnp.minimum(
        jnp.where(window > 0, jnp.maximum(row_start + pos_offset - window + 1, 0) // block_k, 0), num_tiles
    )

    q_copy = pltpu.make_async_copy(q_hbm.at[h, :, pl.ds(row_start, block_q), :], q_buf, sems.at[0, 0])
    q_copy.start()

    def tile_copies(tile, slot):
        copies = []
        for j in range(pages_per_block):
            # Indices past the request's table read its last entry; those keys are masked below.
            page = pt_ref[req * pages_per_req + jnp.minimum(tile * pages_per_block + j, pages_per_req - 1)]
            first = (layer_base + page) * page_size
            dst = pl.ds(j * page_size, page_size)
            copies.append(
                pltpu.make_async_copy(
                    kv_hbm.at[pl.ds(first, page_size), pl.ds(2 * h * head_dim, head_dim)],
                    k_buf.at[slot, dst],
                    sems.at[1, slot],
                )
            )
            copies.append(
                pltpu.make_async_copy(
                    kv_hbm.at[pl.ds(first, page_size), pl.ds((2 * h + 1) * head_dim, head_dim)],
                    v_buf.at[slot, dst],
                    sems.at[2, slot],
                )
            )
        return copies

    @pl.when(first_tile < num_tiles)
    def _():
        for c in tile_copies(first_tile, first_tile % 2):
            c.start()

    q_copy.wait()
    m_rows = group * block_q
    q = q_buf[...].reshape(m_rows, head_dim)
    row_pos = row_start + pos_offset + lax.broadcasted_iota(jnp.int32, (m_rows, block_k), 0) % block_q
    key_iota = lax.broadcasted_iota(jnp.int32, (m_rows, block_k), 1)

    def body(tile, carry):
        m, denom, acc = carry
        slot = tile % 2
        for c in tile_copies(tile, slot):
            c.wait()

        @pl.when(tile + 1 < num_tiles)
        def _():
            for c in tile_copies(tile + 1, 1 - slot):
                c.start()

        k, v = read_pool(k_buf[slot], q.dtype), read_pool(v_buf[slot], q.dtype)  # an fp8 pool widened in VMEM
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        key_pos = tile * block_k + key_iota
        seen = (key_pos <= row_pos) & (key_pos < num_keys) & ((window <= 0) | (key_pos > row_pos - window))
        s = jnp.where(seen, s, _MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        denom = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, denom, acc

    init = (
        jnp.full((m_rows, 1), _MASK, jnp.float32),
        jnp.zeros((m_rows, 1), jnp.float32),
        jnp.zeros((m_rows, head_dim), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(first_tile, num_tiles, body, init)
    out = acc / jnp.where(denom == 0, 1.0, denom)  # a block with no keys (padding, unused) writes zeros
    o_ref[...] = out.reshape(group, block_q, head_dim).astype(o_ref.dtype)


def default_config(num_rows: int, num_reqs: int, page_size: int, dtype) -> dict:
    """block_q: 8 rows for decode batches (one row per request), 32 otherwise, at least the sublane tile
    (16 for 16-bit types); pages_per_block: key tiles of 128 keys."""
    sublanes = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    block_q = max(sublanes, 8 if num_rows <= num_reqs else 32)
    return {"block_q": block_q, "pages_per_block": max(1, 128 // page_size)}


def sgjax_tpu_attention(
    q,
    k,
    v,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    interpret: bool = False,
    window=0,
    softcap: float | None = None,
    **config,
):
    """Backend signature; returns ([T, Hq, D], pool). `config` overrides block_q and pages_per_block.
    `interpret=True` runs the kernel in TPU interpret mode (on CPU)."""
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    (num_rows, num_heads, head_dim, num_layers, num_pages, page_size, num_kv_heads, group, num_reqs, pages_per_req) = (
        rb.batch_dims(q, pool, meta)
    )
    num_combined = 2 * num_kv_heads
    cfg = default_config(num_rows, num_reqs, page_size, q.dtype)
    cfg.update(config)
    block_q, pages_per_block = cfg["block_q"], cfg["pages_per_block"]
    block_k = pages_per_block * page_size

    blocks = rb.block_table(meta, num_rows, block_q)
    num_blocks = blocks.shape[0]
    # [Hkv, G, T + block_q, D]: a program's rows are one DMA that never runs past the end.
    q_t = jnp.pad(
        q.reshape(num_rows, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3), ((0, 0), (0, 0), (0, block_q), (0, 0))
    )
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_block=pages_per_block,
        pages_per_req=pages_per_req,
        pages_per_layer=num_pages,
        scale=sm_scale,
        softcap=softcap,
    )
    out_blocks = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_blocks, num_kv_heads),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, None, group, block_q, head_dim), lambda b, h, *_: (b, h, 0, 0, 0)),
            scratch_shapes=[
                pltpu.VMEM((group, block_q, head_dim), q.dtype),
                pltpu.VMEM((2, block_k, head_dim), pool.dtype),
                pltpu.VMEM((2, block_k, head_dim), pool.dtype),
                pltpu.SemaphoreType.DMA((3, 2)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, group, block_q, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="sgjax_ragged_paged_attention",
    )(
        blocks.reshape(-1),
        meta.kv_lens.astype(jnp.int32),
        meta.page_table.reshape(-1).astype(jnp.int32),
        jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)]),
        q_t,
        pool.reshape(num_layers * num_pages * page_size, num_combined * head_dim),
    )
    return _gather_rows(out_blocks, blocks, num_rows), pool


def _gather_rows(out_blocks, blocks, num_rows: int):
    """[B, Hkv, G, block_q, D] per-block outputs -> [T, Hkv * G, D], each row from the block that owns it."""
    num_blocks, num_kv_heads, group, block_q, head_dim = out_blocks.shape
    offsets = jnp.arange(block_q, dtype=jnp.int32)
    rows = blocks[:, rb.ROW_START, None] + offsets[None, :]
    owned = rows < blocks[:, rb.ROW_END, None]  # unused blocks have start == end == 0: nothing
    flat = jnp.arange(num_blocks * block_q, dtype=jnp.int32).reshape(num_blocks, block_q)
    source = jnp.zeros((num_rows,), jnp.int32).at[jnp.where(owned, rows, num_rows)].set(flat, mode="drop")
    by_row = out_blocks.transpose(0, 3, 1, 2, 4).reshape(num_blocks * block_q, num_kv_heads * group, head_dim)
    return by_row[source]
