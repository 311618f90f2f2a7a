"""The reference attention backend: pure jnp gather + masked softmax.

Runs everywhere and defines the semantics the Pallas kernels are tested against. Two exact strategies,
chosen statically from the shapes (both are tested on every case):
- "gather": each query row gathers its own request's pages. Memory traffic grows with T x context, so
  it suits decode-heavy batches (few rows per request).
- "segment": the pages of all R requests are gathered once and every row attends to all of them with
  a same-request mask. Work grows with T x R x context, so it suits prefill (few requests, many rows).
- "blocked" (the CPU's choice): rows go in blocks of ROWS_PER_BLOCK; a block whose rows all belong to one
  request gathers that request's pages once (prefill), a block of several requests gathers per row (decode),
  and a block of padding rows does nothing. Work is the real rows' T x context only, whatever R and the
  padding. The choice is a lax.switch per block: free on a CPU, where a conditional blocks nothing (on a GPU
  it would read the predicate back to the host, engine/sampler.py).
Query rows are processed in blocks sized to bound the intermediates' memory. Neither is a GPU fast path; the kernels are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgjax.kernels.kv_pool import split_kv, write_kv
from sgjax.kernels.metadata import AttentionMetadata

_BLOCK_ELEMENTS = 1 << 25  # intermediates per block of query rows (~128 MB in f32)
ROWS_PER_BLOCK = 16  # "blocked": few enough that a decode block's padding rows stay cheap, enough to amortise a block


def row_request(cu_q_lens, num_rows: int):
    """For each of the T rows: its request index (clipped) and whether it is a real (unpadded) row."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    num_reqs = cu_q_lens.shape[0] - 1
    # compare_all: the default searchsorted is a sequential loop, a launch and sync per step on GPUs.
    req = jnp.searchsorted(cu_q_lens, rows, side="right", method="compare_all").astype(jnp.int32) - 1
    valid = rows < cu_q_lens[-1]
    return jnp.clip(req, 0, num_reqs - 1), valid


def choose_strategy(num_reqs: int, num_heads: int, num_kv_heads: int, head_dim: int, num_rows: int = 0) -> str:
    """By cost, from the shapes alone. Per row, "gather" moves context x 2*Hkv*D elements and "segment" computes
    R x context x Hq scores. On a CPU (scripts/probes/probe_cpu_attention.py, docs/engine.md "CPU attention"):
    "gather" when rows are about one per request (decode), else "blocked", whose work does not grow with padding."""
    if jax.default_backend() == "cpu" and num_rows and num_reqs > 1:  # one request: "segment" is its exact work
        if num_rows <= 2 * num_reqs:
            return "gather"
        if num_rows % ROWS_PER_BLOCK == 0:
            return "blocked"
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
        strategy = choose_strategy(num_reqs, num_heads, num_kv_heads, head_dim, num_rows)
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

    def attend(qb, pos_b, len_b, keys, values, kpos, same, per_row: bool):
        """Rows qb [b, Hq, D] against keys/values ([b, ctx, Hkv, D] per row, or [K, Hkv, D] shared) where `same`
        (or everywhere) and kpos < len, kpos <= pos, inside the window."""
        b = qb.shape[0]
        qg = qb.reshape(b, num_kv_heads, group, head_dim)
        spec = "bkhd" if per_row else "khd"
        s = jnp.einsum(f"bhgd,{spec}->bhgk", qg, keys, preferred_element_type=jnp.float32)
        mask = (kpos < len_b[:, None]) & (kpos <= pos_b[:, None])
        if same is not None:
            mask = mask & same
        if not (isinstance(window, int) and window == 0):
            mask = mask & ((window <= 0) | (kpos > pos_b[:, None] - window))
        s = s * sm_scale
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        probs = _masked_softmax(s, mask[:, None, None, :])
        out = jnp.einsum(f"bhgk,{spec}->bhgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
        return out.reshape(b, num_heads, head_dim).astype(q.dtype)

    def gathered(table_rows):
        kv = pool[layer, table_rows].reshape(*table_rows.shape[:-1], ctx, 2 * num_kv_heads, head_dim)
        return split_kv(kv)

    def per_row(qb, req_b, pos_b, len_b):
        keys, values = gathered(meta.page_table[req_b])
        return attend(qb, pos_b, len_b, keys, values, jnp.arange(ctx)[None, :], None, True)

    def one_request(qb, req_b, pos_b, len_b):
        keys, values = gathered(meta.page_table[req_b[0]])
        return attend(qb, pos_b, len_b, keys, values, jnp.arange(ctx)[None, :], None, False)

    def block(args):
        qb, req_b, pos_b, len_b = args
        if strategy == "gather":
            return per_row(qb, req_b, pos_b, len_b)
        if strategy == "segment":
            same = key_req[None, :] == req_b[:, None]
            return attend(qb, pos_b, len_b, all_keys, all_values, key_pos[None, :], same, False)
        # blocked: nothing for padding, one gather for a block of one request, a gather per row otherwise
        which = jnp.where(jnp.all(len_b == 0), 0, jnp.where(jnp.all(req_b == req_b[0]), 1, 2))
        return jax.lax.switch(which, (lambda *a: jnp.zeros_like(qb), one_request, per_row), qb, req_b, pos_b, len_b)

    if strategy == "blocked":
        blk = ROWS_PER_BLOCK if num_rows % ROWS_PER_BLOCK == 0 else num_rows
    else:
        keys = ctx * (num_reqs if strategy == "segment" else 1)
        per_row_elems = num_heads * keys + (ctx * 2 * num_kv_heads * head_dim if strategy == "gather" else 0)
        blk = num_rows
        while blk > 1 and blk % 2 == 0 and blk * per_row_elems > _BLOCK_ELEMENTS:
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
