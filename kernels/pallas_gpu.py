"""Ragged paged attention for CUDA GPUs in Pallas-Triton (installed as sgjax.kernels.pallas_gpu).

One kernel serves decode, prefill and extend rows in the same batch (vLLM's "unified attention"
shape). Grid (query block, KV head, KV split):
- a query block is `block_q` rows of one request (kernels.ragged_blocks), and the G = Hq/Hkv query
  heads of the program's KV head are packed with them into the M = block_q * G rows of each dot, so
  K/V tiles are loaded once for the whole group;
- the program walks its request's keys in tiles of `block_k`, gathering each key's slot through the
  page table (any page size), with an online softmax in fp32; only tiles that reach past the first
  row's position need the causal mask, so they run in a second loop;
- with `num_splits` > 1 the tiles are split across programs (split-K, for decode with few requests
  and long contexts) and a log-sum-exp combine in XLA merges the partial outputs.

The pool is read in place: it is viewed as [L * pages * page_size, 2 * Hkv * D] (a bitcast), and
the layer enters as an offset inside the kernel, never as a slice (that would copy a layer).
Every load and store uses integer-array indices only, the one form both the Triton lowering and
interpret mode (which rejects mixing arrays with pl.ds) accept. Pallas-Triton needs power-of-two
block shapes: G is padded to a power of two by the wrapper, head_dim must be one.

Pallas-Triton is deprecated from jax 0.11; this module and kv_write_gpu are the only ones that import it.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sgjax.kernels import ragged_blocks as rb
from sgjax.kernels.kv_pool import read_pool, write_kv
from sgjax.kernels.kv_write_gpu import pallas_write_kv
from sgjax.kernels.metadata import AttentionMetadata

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # jax 0.11 deprecates the Triton backend
    from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite, so masked rows never make inf - inf
_EMPTY_LSE = -1e30  # log-sum-exp of a split that saw no key: weight exp2(-1e30 - m) = 0
# A batch bucket goes to the Mosaic GPU prefill kernel only with this many rows per request slot: it
# spends a tile of 64 tensor-core rows on each request's last rows, so decode rows would waste it (a bucket
# of 64 decodes at 4k beside two 1k extends has 32 rows per slot and stays on Triton).
MGPU_MIN_ROWS_PER_REQ = 64


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def _kernel(
    blk_ref,
    layer_ref,
    pt_ref,
    q_ref,
    kv_ref,
    *out_refs,
    block_q,
    group,
    block_k,
    page_size,
    pages_per_req,
    pages_per_layer,
    num_heads,
    head_dim,
    num_splits,
    scale,
    prefetch_pages,
    softcap,
):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row_start, row_end = blk_ref[b, rb.ROW_START], blk_ref[b, rb.ROW_END]
    pos_offset, req = blk_ref[b, rb.POS_OFFSET], blk_ref[b, rb.REQUEST]
    layer_base = layer_ref[0] * pages_per_layer
    window = layer_ref[1]  # 0: none; else a row at p sees keys (p - window, p]
    num_rows = q_ref.shape[0] // num_heads
    m_rows = block_q * group

    # Row m of the dots is token row_start + m // G, query head h * G + m % G.
    m = jnp.arange(m_rows, dtype=jnp.int32)
    token = row_start + m // group
    row_ok = (token < row_end) & (token < num_rows)
    q_row = token * num_heads + h * group + m % group  # into q viewed as [T * Hq, D]
    d = jnp.arange(head_dim, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[q_row[:, None], d[None, :]], mask=row_ok[:, None], other=0)
    pos = token + pos_offset  # absolute position of each row

    # Keys [first, kv_end) cover every row of the block (causal, and the window's lower edge for the first row);
    # without a window the tiles up to n_full need no mask, with one every tile is masked (its edge moves by row).
    last_row = jnp.minimum(row_start + block_q, row_end)
    kv_end = jnp.maximum(last_row + pos_offset, 0)
    n_tiles = (kv_end + block_k - 1) // block_k
    first_tile = jnp.where(window > 0, jnp.maximum(row_start + pos_offset - window + 1, 0) // block_k, 0)
    per_split = (n_tiles - first_tile + num_splits - 1) // num_splits
    lo = jnp.minimum(first_tile + split * per_split, n_tiles)
    hi = jnp.minimum(lo + per_split, n_tiles)
    n_full = jnp.where(window > 0, lo, jnp.clip((row_start + pos_offset + 1) // block_k, lo, hi))

    # Pallas-Triton runs fp32 dots at DEFAULT precision as TF32 (~1e-3 error); fp32 is the exact mode.
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    k_col = (2 * h) * head_dim + d  # K of head h at combined index 2h, V at 2h + 1
    v_col = k_col + head_dim
    j = jnp.arange(block_k, dtype=jnp.int32)

    def pages_of(t):
        page_idx = (t * block_k + j) // page_size
        return plgpu.load(pt_ref.at[req * pages_per_req + page_idx], mask=page_idx < pages_per_req, other=0)

    def tile(t, carry, masked):
        acc, m_i, l_i, page = carry
        key = t * block_k + j
        if prefetch_pages:  # this tile's pages came with the carry; fetch the next tile's now
            page, next_page = page, pages_of(t + 1)
        else:
            page = next_page = pages_of(t)
        slot = (layer_base + page) * page_size + key % page_size
        k = read_pool(kv_ref[slot[:, None], k_col[None, :]], q.dtype)  # an fp8 pool widened in registers
        v = read_pool(kv_ref[slot[:, None], v_col[None, :]], q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        # scores in log2 units: scale is sm_scale * log2(e); a soft cap applies to the natural-unit score
        s = (softcap * _LOG2E) * jnp.tanh(s * (scale / _LOG2E / softcap)) if softcap else s * scale
        if masked:
            valid = (key[None, :] <= pos[:, None]) & ((window <= 0) | (key[None, :] > pos[:, None] - window))
            s = jnp.where(valid, s, _MASK)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(valid, p, 0.0)  # a row with no valid key in this tile adds nothing
        alpha = jnp.exp2(m_i - m_new)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        return acc * alpha[:, None] + pv, m_new, l_i * alpha + jnp.sum(p, axis=1), next_page

    carry = (
        jnp.zeros((m_rows, head_dim), jnp.float32),
        jnp.full((m_rows,), _MASK, jnp.float32),
        jnp.zeros((m_rows,), jnp.float32),
        pages_of(lo) if prefetch_pages else jnp.zeros_like(j),
    )
    carry = jax.lax.fori_loop(lo, n_full, functools.partial(tile, masked=False), carry)
    acc, m_i, l_i, _ = jax.lax.fori_loop(n_full, hi, functools.partial(tile, masked=True), carry)

    out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[q_row[:, None], d[None, :]], out.astype(o_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, lse_ref = out_refs
        plgpu.store(o_ref.at[split, q_row[:, None], d[None, :]], out, mask=row_ok[:, None])
        lse = jnp.where(l_i > 0.0, m_i + jnp.log2(jnp.where(l_i > 0.0, l_i, 1.0)), _EMPTY_LSE)
        plgpu.store(lse_ref.at[split, q_row], lse, mask=row_ok)


def default_config(
    num_rows: int,
    num_reqs: int,
    group: int,
    num_kv_heads: int,
    context: int,
    num_cores: int = 132,
    short_only: bool = False,
) -> dict:
    """Static block sizes from the shapes alone (the kernel is compiled once per bucket).

    Decode-shaped buckets (no more rows than requests) use M = 16 rows, the smallest tensor-core dot,
    since each block holds one token, and long key tiles; longer ones use M = 64. Splits are added
    until about two programs per core exist, but never below 4 key tiles per split. The numbers
    come from the H200 sweeps in docs/journal/kernels-h200.md. `short_only`: the kernel sees only a mixed bucket's
    decodes
    and short extends (the Hopper kernel takes its long requests), so it gets decode blocks, about one per request.
    """
    decode = num_rows <= num_reqs or short_only
    block_m = 16 if decode else 64
    block_k = 128 if decode else 32
    block_q = max(1, block_m // group)
    est_blocks = num_reqs if short_only else max(min(num_rows, num_reqs), -(-num_rows // block_q))
    want = (2 * num_cores) // (est_blocks * num_kv_heads)
    num_splits = min(_pow2_floor(want), _pow2_floor(context // (4 * block_k)))
    return dict(
        block_q=block_q,
        block_k=block_k,
        num_splits=num_splits,
        num_warps=4,
        num_stages=2 if decode else 3,
        prefetch_pages=not decode,
    )


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def _num_cores() -> int:
    dev = jax.devices()[0]
    return getattr(dev, "core_count", None) or 132


def pallas_gpu_attention(
    q,
    k,
    v,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    interpret: bool = False,
    kv_write: str | None = None,
    prefill_kernel: str = "auto",
    mgpu: dict | None = None,
    window=0,
    softcap: float | None = None,
    **config,
):
    """The `pallas` backend on GPU (and in interpret mode on CPU). Returns ([T, Hq, D], pool).

    `config` overrides default_config's block_q, block_k, num_splits, num_warps, num_stages,
    prefetch_pages. `kv_write`: "pallas" (kv_write_gpu's kernel, the GPU default: faster than the
    scatter, kv_write_gpu.py) or "xla" (kv_pool.write_kv's scatter, the interpret-mode default,
    where the kernel's op-by-op run only slows the tests; test_kv_write covers it there).
    `prefill_kernel`: "mgpu" sends the requests of at least MGPU_MIN_ROWS_PER_REQ new rows to pallas_mgpu's Hopper
    kernel when it supports the shapes, with `mgpu` as its block sizes (it took the H200's long prefills to about
    60% of the Triton kernel's time, docs/journal/kernels-h200.md); a prefill-shaped bucket (that many rows per request
    slot) goes to it whole, a mixed
    one is split by request. "triton" keeps everything on this module's kernel; "auto" (the default) is "mgpu" on
    a Hopper GPU and "triton" elsewhere (wgmma exists only on sm_90). With `interpret`, "mgpu" runs the Hopper
    kernel in jax's GPU interpret mode (tests) and "auto" is "triton".
    `window` (an int or traced int32, 0: none) and `softcap` (Gemma): both kernels apply them.
    """
    kv_write = kv_write or ("xla" if interpret else "pallas")
    if kv_write == "pallas":
        pool = pallas_write_kv(pool, layer, k, v, meta.slot_mapping, interpret=interpret)
    elif kv_write == "xla":
        pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    else:
        raise ValueError(f"kv_write must be 'xla' or 'pallas', got {kv_write!r}")
    (num_rows, num_heads, head_dim, num_layers, num_pages, page_size, num_kv_heads, group, num_reqs, pages_per_req) = (
        rb.batch_dims(q, pool, meta)
    )
    if prefill_kernel not in ("auto", "triton", "mgpu"):
        raise ValueError(f"prefill_kernel must be 'auto', 'triton' or 'mgpu', got {prefill_kernel!r}")
    if prefill_kernel == "auto":
        prefill_kernel = "triton" if interpret or not _is_hopper() else "mgpu"
    masks = dict(window=window, softcap=softcap)
    # Decode-shaped buckets (no more rows than requests) stay on the Triton kernel: no request can be long there.
    if prefill_kernel == "mgpu" and num_rows >= MGPU_MIN_ROWS_PER_REQ and num_rows > num_reqs:
        from sgjax.kernels import pallas_mgpu

        mgpu = dict(mgpu or {}, interpret=interpret)
        routed = pool.dtype == q.dtype or pallas_mgpu.ROUTE_FP8_POOLS
        if routed and pallas_mgpu.supported(q.dtype, head_dim, page_size, mgpu.get("block_kv"), kv_dtype=pool.dtype):
            if num_rows >= MGPU_MIN_ROWS_PER_REQ * num_reqs:  # prefill-shaped: every request on the Hopper kernel
                return pallas_mgpu.mgpu_prefill_attention(
                    q, pool, layer, meta, sm_scale=sm_scale, **mgpu, **masks
                ), pool
            # A mixed bucket: requests of at least MGPU_MIN_ROWS_PER_REQ new rows (and the padding) go to the
            # Hopper kernel, the decodes and short extends to the Triton kernel with its decode blocks; each
            # kernel's grid has programs for the other's requests that find no rows, and rows are picked after.
            long_req = rb.long_requests(meta, MGPU_MIN_ROWS_PER_REQ)
            long_out = pallas_mgpu.mgpu_prefill_attention(
                q, pool, layer, meta, sm_scale=sm_scale, include=long_req, **mgpu, **masks
            )
            short_out = _triton_attention(
                q, pool, layer, meta, sm_scale=sm_scale, interpret=interpret, include=~long_req, config=config, **masks
            )
            return jnp.where(rb.row_mask(meta, num_rows, long_req)[:, None, None], long_out, short_out), pool
    return _triton_attention(q, pool, layer, meta, sm_scale=sm_scale, interpret=interpret, config=config, **masks), pool


def _triton_attention(
    q,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    interpret: bool,
    config: dict,
    include=None,
    window=0,
    softcap: float | None = None,
):
    """This module's kernel over the requests in `include` (bool[R + 1], padding last; None: all). With
    `include`, the bucket's other requests are the Hopper kernel's, so the blocks are sized for decodes."""
    (num_rows, num_heads, head_dim, num_layers, num_pages, page_size, num_kv_heads, group, num_reqs, pages_per_req) = (
        rb.batch_dims(q, pool, meta)
    )
    num_combined = 2 * num_kv_heads
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two for Pallas-Triton")
    g = _pow2_ceil(group)
    if g != group:  # e.g. Qwen2-0.5B's 14/2: pad the group with zero query heads, dropped below
        q = jnp.pad(q.reshape(num_rows, num_kv_heads, group, head_dim), ((0, 0), (0, 0), (0, g - group), (0, 0)))
        q = q.reshape(num_rows, num_kv_heads * g, head_dim)
    cfg = default_config(
        num_rows,
        num_reqs,
        g,
        num_kv_heads,
        pages_per_req * page_size,
        1 if interpret else _num_cores(),
        short_only=include is not None,
    )
    cfg.update(config)
    block_q, num_splits = cfg["block_q"], cfg["num_splits"]
    heads = num_kv_heads * g

    blocks = rb.block_table(meta, num_rows, block_q, include)
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group=g,
        block_k=cfg["block_k"],
        page_size=page_size,
        pages_per_req=pages_per_req,
        pages_per_layer=num_pages,
        num_heads=heads,
        head_dim=head_dim,
        num_splits=num_splits,
        scale=sm_scale * _LOG2E,
        prefetch_pages=cfg["prefetch_pages"],
        softcap=softcap,
    )
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((num_rows * heads, head_dim), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, num_rows * heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_rows * heads), jnp.float32),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(blocks.shape[0], num_kv_heads, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="ragged_paged_attention",
    )(
        blocks,
        jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(window, jnp.int32)]),
        meta.page_table.reshape(-1).astype(jnp.int32),
        q.reshape(num_rows * heads, head_dim),
        pool.reshape(num_layers * num_pages * page_size, num_combined * head_dim),
    )
    out = outs[0] if num_splits == 1 else _combine(*outs).astype(q.dtype)
    out = out.reshape(num_rows, num_kv_heads, g, head_dim)[:, :, :group]
    return out.reshape(num_rows, num_heads, head_dim)


def _combine(o, lse):
    """Merge split-K partials: o [S, N, D] each normalised by its own sum, lse [S, N] (log2)."""
    m = jnp.max(lse, axis=0)
    w = jnp.exp2(lse - m[None])
    return jnp.sum(o * w[..., None], axis=0) / jnp.sum(w, axis=0)[:, None]
