"""The reference attention backend: pure jnp gather + masked softmax.

Runs everywhere and defines the semantics the Pallas kernels are tested against. Two exact strategies,
chosen statically from the shapes (both are tested on every case):
- "gather": each query row gathers its own request's pages. Memory traffic grows with T x context, so
  it suits decode-heavy batches (few rows per request).
- "segment": the pages of all R requests are gathered once and every row attends to all of them with
  a same-request mask. Work grows with T x R x context, so it suits prefill (few requests, many rows).
Query rows are processed in blocks sized to bound the intermediates' memory. Neither is a GPU fast path; the kernels are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgjax.kernels.kv_pool import split_kv, write_kv
from sgjax.kernels.metadata import AttentionMetadata

_BLOCK_ELEMENTS = 1 << 25  # intermediates per block of query rows (~128 MB in f32)


def row_request(cu_q_lens, num_rows: int):
    """For each of the T rows: its request index (clipped) and whether it is a real (unpadded) row."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    num_reqs = cu_q_lens.shape[0] - 1
    # compare_all: the default searchsorted is a sequential loop, a launch and sync per step on GPUs.
    req = jnp.searchsorted(cu_q_lens, rows, side="right", method="compare_all").astype(jnp.int32) - 1
    valid = rows < cu_q_lens[-1]
    return jnp.clip(req, 0, num_reqs - 1), valid


def choose_strategy(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    # Per row, "gather" moves context x 2*Hkv*D elements and "segment" computes R x context x Hq scores.
    return "segment" if num_reqs * num_heads <= 2 * num_kv_heads * head_dim else "gather"


def ref_attention(q, k, v, pool, layer, meta: AttentionMetadata, *, sm_scale: float, strategy: str = "auto",
                  window=0, softcap: float | None = None):
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns ([T, Hq, D], pool).

    window (an int or a traced int32; 0: none): a row at position p sees keys p - window < k <= p (HF's sliding
    window). softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_reqs, pages_per_req = meta.page_table.shape
    ctx = pages_per_req * pool.shape[2]
    if strategy == "auto":
        strategy = choose_strategy(num_reqs, num_heads, num_kv_heads, head_dim)
    req, valid = row_request(meta.cu_q_lens, num_rows)
    q_len = meta.cu_q_lens[req + 1] - meta.cu_q_lens[req]
    # Absolute position of each query row: its request's new tokens end at kv_len.
    q_pos = meta.kv_lens[req] - q_len + (jnp.arange(num_rows) - meta.cu_q_lens[req])
    kv_len = jnp.where(valid, meta.kv_lens[req], 0)
    group = num_heads // num_kv_heads

    if strategy == "segment":
        all_kv = pool[layer, meta.page_table].reshape(num_reqs * ctx, 2 * num_kv_heads, head_dim)
        all_keys, all_values = split_kv(all_kv)
        key_pos = jnp.tile(jnp.arange(ctx), num_reqs)
        key_req = jnp.repeat(jnp.arange(num_reqs), ctx)

    def block(args):
        qb, req_b, pos_b, len_b = args
        b = qb.shape[0]
        qg = qb.reshape(b, num_kv_heads, group, head_dim)
        if strategy == "gather":
            kv = pool[layer, meta.page_table[req_b]].reshape(b, ctx, 2 * num_kv_heads, head_dim)
            keys, values = split_kv(kv)
            s = jnp.einsum("bhgd,bkhd->bhgk", qg, keys, preferred_element_type=jnp.float32)
            kpos = jnp.arange(ctx)[None, :]
            mask = (kpos < len_b[:, None]) & (kpos <= pos_b[:, None])
        else:
            s = jnp.einsum("bhgd,khd->bhgk", qg, all_keys, preferred_element_type=jnp.float32)
            kpos = key_pos[None, :]
            mask = (key_req[None, :] == req_b[:, None]) & (kpos < len_b[:, None]) & (kpos <= pos_b[:, None])
        if not (isinstance(window, int) and window == 0):
            mask = mask & ((window <= 0) | (kpos > pos_b[:, None] - window))
        s = s * sm_scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        probs = _masked_softmax(s, mask[:, None, None, :])
        if strategy == "gather":
            out = jnp.einsum("bhgk,bkhd->bhgd", probs.astype(values.dtype), values,
                             preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("bhgk,khd->bhgd", probs.astype(all_values.dtype), all_values,
                             preferred_element_type=jnp.float32)
        return out.reshape(b, num_heads, head_dim).astype(q.dtype)

    keys = ctx * (num_reqs if strategy == "segment" else 1)
    per_row = num_heads * keys + (ctx * 2 * num_kv_heads * head_dim if strategy == "gather" else 0)
    blk = num_rows
    while blk > 1 and blk % 2 == 0 and blk * per_row > _BLOCK_ELEMENTS:
        blk //= 2  # few large blocks: each lax.map iteration runs sequentially
    n = num_rows // blk
    args = (q.reshape(n, blk, num_heads, head_dim), req.reshape(n, blk), q_pos.reshape(n, blk),
            kv_len.reshape(n, blk))
    out = block(jax.tree.map(lambda a: a[0], args)) if n == 1 else jax.lax.map(block, args)
    return out.reshape(num_rows, num_heads, head_dim), pool


def _masked_softmax(s, mask):
    """Softmax over the last axis where mask holds; fully masked (padded) rows give zeros, not NaN."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(denom == 0, 1.0, denom)
