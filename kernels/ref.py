"""The reference attention backend: pure jnp gather + masked softmax.

Runs everywhere and defines the semantics the Pallas kernels are tested against. Each query row
gathers its request's pages (memory grows with T x pages_per_request x page_size), so query rows are
processed in blocks to bound it; fine for CPU serving and tests, not a GPU fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgjax.kernels.kv_pool import split_kv, write_kv
from sgjax.kernels.metadata import AttentionMetadata

_ROW_BLOCK = 64


def row_request(cu_q_lens, num_rows: int):
    """For each of the T rows: its request index (clipped) and whether it is a real (unpadded) row."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    num_reqs = cu_q_lens.shape[0] - 1
    req = jnp.searchsorted(cu_q_lens, rows, side="right").astype(jnp.int32) - 1
    valid = rows < cu_q_lens[-1]
    return jnp.clip(req, 0, num_reqs - 1), valid


def ref_attention(q, k, v, pool, layer, meta: AttentionMetadata, *, sm_scale: float):
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns ([T, Hq, D], pool)."""
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    page_size = pool.shape[2]
    req, valid = row_request(meta.cu_q_lens, num_rows)
    q_len = meta.cu_q_lens[req + 1] - meta.cu_q_lens[req]
    # Absolute position of each query row: its request's new tokens end at kv_len.
    q_pos = meta.kv_lens[req] - q_len + (jnp.arange(num_rows) - meta.cu_q_lens[req])
    kv_len = jnp.where(valid, meta.kv_lens[req], 0)

    def block(args):
        qb, req_b, pos_b, len_b = args
        kv = pool[layer, meta.page_table[req_b]]  # [B, P, S, 2Hkv, D]
        b, p = kv.shape[:2]
        keys, values = split_kv(kv.reshape(b, p * page_size, 2 * num_kv_heads, head_dim))
        qg = qb.reshape(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        s = jnp.einsum("bhgd,bkhd->bhgk", qg, keys, preferred_element_type=jnp.float32) * sm_scale
        kpos = jnp.arange(p * page_size)
        mask = (kpos[None, :] < len_b[:, None]) & (kpos[None, :] <= pos_b[:, None])
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.where(mask[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        probs = e / jnp.where(denom == 0, 1.0, denom)  # fully masked (padded) rows give zeros, not NaN
        out = jnp.einsum("bhgk,bkhd->bhgd", probs.astype(values.dtype), values,
                         preferred_element_type=jnp.float32)
        return out.reshape(b, num_heads, head_dim).astype(q.dtype)

    blk = min(_ROW_BLOCK, num_rows)
    if num_rows % blk:
        blk = num_rows
    n = num_rows // blk
    args = (q.reshape(n, blk, num_heads, head_dim), req.reshape(n, blk), q_pos.reshape(n, blk),
            kv_len.reshape(n, blk))
    out = block(jax.tree.map(lambda a: a[0], args)) if n == 1 else jax.lax.map(block, args)
    return out.reshape(num_rows, num_heads, head_dim), pool
