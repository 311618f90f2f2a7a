"""The reference attention backend: pure jnp gather + masked softmax.

Runs everywhere and defines the semantics the Pallas kernels are tested against. Two exact strategies,
chosen statically from the shapes (both are tested on every case):
- "gather": each query row gathers its own request's pages. Memory traffic grows with T x context, so
  it suits decode-heavy batches (few rows per request).
- "segment": the pages of all R requests are gathered once and every row attends to all of them with
  a same-request mask. Work grows with T x R x context, so it suits prefill (few requests, many rows).
- "paged" (the CPU's decode): each row reads its request's pages one at a time, in a loop over the pages the
  longest row uses, with an online softmax: no gathered copy of the padded context, and no work past the
  real lengths. On a GPU a loop of tiny steps is the wrong shape; the kernels are the fast path there.
- "blocked" (the CPU's choice otherwise): rows go in blocks of ROWS_PER_BLOCK; a block whose rows all belong
  to one request runs "paged" reading that request's pages once for all its rows (prefill: up to the block's
  last position, so the causal half is skipped), a block of several requests runs "paged" per row (decode
  rows), and a block of padding rows does nothing. Work is the real rows' T x (seen) context only, whatever
  R and the padding. The choice is a lax.switch per block: free on a CPU, where a conditional blocks nothing
  (on a GPU it would read the predicate back to the host, engine/sampler.py).
Query rows are processed in blocks sized to bound the intermediates' memory. None is a GPU fast path; the kernels are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sgjax.kernels.kv_pool import read_pool, split_kv, write_kv
from sgjax.kernels.metadata import AttentionMetadata

_BLOCK_ELEMENTS = 1 << 25  # intermediates per block of query rows (~128 MB in f32)
PAGES_PER_STEP = 4  # "paged": pages read per loop step (each step costs a loop iteration's overhead)
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
    R x context x Hq scores. On a CPU (docs/journal/engine-cpu.md, "CPU attention and step sizes"):
    "paged" when rows are about one per request (decode), else "blocked", whose work does not grow with padding."""
    if jax.default_backend() == "cpu" and num_rows:
        if num_reqs > 1 and num_rows <= 2 * num_reqs:
            return "paged"
        if num_rows % ROWS_PER_BLOCK == 0:  # one request too: its blocks stop at their last row's position
            return "blocked"
    return "segment" if num_reqs * num_heads <= 2 * num_kv_heads * head_dim else "gather"


def ref_attention(
    q,
    k,
    v,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    strategy: str = "auto",
    window=0,
    softcap: float | None = None,
):
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
        all_keys, all_values = split_kv(read_pool(all_kv, q.dtype))
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
        return split_kv(read_pool(kv, q.dtype))

    def per_row(qb, req_b, pos_b, len_b):
        keys, values = gathered(meta.page_table[req_b])
        return attend(qb, pos_b, len_b, keys, values, jnp.arange(ctx)[None, :], None, True)

    def paged(qb, req_b, pos_b, len_b, shared: bool = False):
        """Rows against their requests' pages, PAGES_PER_STEP pages a loop step with an online softmax, up to the
        last key any row sees; shared: every row is one request's, whose pages are read once for all of them."""
        b, page_size = qb.shape[0], pool.shape[2]
        chunk = PAGES_PER_STEP * page_size
        qg = qb.reshape(b, num_kv_heads, group, head_dim)
        tables = meta.page_table[req_b[0]] if shared else meta.page_table[req_b]
        spec = "khd" if shared else "bkhd"
        windowed = not (isinstance(window, int) and window == 0)

        def step(i, carry):
            m, den, acc = carry
            cols = jnp.minimum(i * PAGES_PER_STEP + jnp.arange(PAGES_PER_STEP), pages_per_req - 1)
            kv = pool[layer, tables[..., cols]].reshape(*tables.shape[:-1], chunk, 2 * num_kv_heads, head_dim)
            keys, values = split_kv(read_pool(kv, q.dtype))  # a clipped column's keys lie past every length: masked
            kpos = i * chunk + jnp.arange(chunk)[None, :]
            s = jnp.einsum(f"bhgd,{spec}->bhgk", qg, keys, preferred_element_type=jnp.float32) * sm_scale
            if softcap:
                s = softcap * jnp.tanh(s / softcap)
            mask = (kpos < len_b[:, None]) & (kpos <= pos_b[:, None])
            if windowed:
                mask = mask & ((window <= 0) | (kpos > pos_b[:, None] - window))
            s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that saw nothing yet keeps zeros
            scale, e = jnp.exp(m - base), jnp.exp(s - base[..., None])
            pv = jnp.einsum(f"bhgk,{spec}->bhgd", e.astype(values.dtype), values, preferred_element_type=jnp.float32)
            return m_new, den * scale + jnp.sum(e, axis=-1), acc * scale[..., None] + pv

        seen = jnp.minimum(len_b, pos_b + 1)  # keys a row sees end here (0 for padding rows)
        steps = (pages_per_req + PAGES_PER_STEP - 1) // PAGES_PER_STEP
        last = jnp.minimum((jnp.max(seen) + chunk - 1) // chunk, steps)
        first = jnp.int32(0)
        if windowed:  # the pages before every row's window hold nothing it sees
            lo = jnp.min(jnp.where(seen > 0, pos_b - window + 1, jnp.iinfo(jnp.int32).max))
            first = jnp.where(window > 0, jnp.clip(lo, 0, None) // chunk, 0).astype(jnp.int32)
        init = (
            jnp.full((b, num_kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((b, num_kv_heads, group), jnp.float32),
            jnp.zeros((b, num_kv_heads, group, head_dim), jnp.float32),
        )
        _, den, acc = jax.lax.fori_loop(first, last.astype(jnp.int32), step, init)
        out = acc / jnp.where(den == 0, 1.0, den)[..., None]
        return out.reshape(b, num_heads, head_dim).astype(q.dtype)

    def block(args):
        qb, req_b, pos_b, len_b = args
        if strategy == "gather":
            return per_row(qb, req_b, pos_b, len_b)
        if strategy == "paged":
            return paged(qb, req_b, pos_b, len_b)
        if strategy == "segment":
            same = key_req[None, :] == req_b[:, None]
            return attend(qb, pos_b, len_b, all_keys, all_values, key_pos[None, :], same, False)
        # blocked: nothing for padding, one request's pages read once for a block of its rows, per row otherwise
        which = jnp.where(jnp.all(len_b == 0), 0, jnp.where(jnp.all(req_b == req_b[0]), 1, 2))
        branches = (lambda *a: jnp.zeros_like(qb), functools.partial(paged, shared=True), paged)
        return jax.lax.switch(which, branches, qb, req_b, pos_b, len_b)

    if strategy == "blocked":
        blk = ROWS_PER_BLOCK if num_rows % ROWS_PER_BLOCK == 0 else num_rows
    elif strategy == "paged":
        blk = num_rows  # its intermediates are one page's
    else:
        keys = ctx * (num_reqs if strategy == "segment" else 1)
        per_row_elems = num_heads * keys + (ctx * 2 * num_kv_heads * head_dim if strategy == "gather" else 0)
        blk = num_rows
        while blk > 1 and blk % 2 == 0 and blk * per_row_elems > _BLOCK_ELEMENTS:
            blk //= 2  # few large blocks: each lax.map iteration runs sequentially
    n = num_rows // blk
    args = (q.reshape(n, blk, num_heads, head_dim), req.reshape(n, blk), q_pos.reshape(n, blk), kv_len.reshape(n, blk))
    out = block(jax.tree.map(lambda a: a[0], args)) if n == 1 else jax.lax.map(block, args)
    return out.reshape(num_rows, num_heads, head_dim), pool


def _masked_softmax(s, mask):
    """Softmax over the last axis where mask holds; fully masked (padded) rows give zeros, not NaN."""
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(denom == 0, 1.0, denom)
