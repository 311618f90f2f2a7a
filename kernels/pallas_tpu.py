"""The `pallas` backend on TPU: jax's ragged paged attention behind our interface (sgjax.kernels.pallas_tpu).

jax.experimental.pallas.ops.tpu.ragged_paged_attention takes one layer's pages
[num_pages, page_size, 2 * Hkv, D] with K/V interleaved per head: our pool's layout per layer. The
layer is folded into the page table instead of sliced out (a slice would copy the layer): the pool
is viewed as [L * num_pages, ...] (a bitcast) and every page index is offset by layer * num_pages.
The op attends to kv_lens[r] keys of request r with the same causal rule as ours and takes the
number of live requests as `num_seqs`; our padded requests (q_len 0, kv_len 0) are passed as live
ones, which the op skips cheaply, so no count has to be computed.

Its tuned block sizes exist only for real TPU generations (it raises elsewhere), so the block
sizes can be given explicitly, as the CPU tests do.

`tpu_kernel="sgjax"` selects our own kernel (kernels/pallas_tpu_kernel.py) instead. jax's stays the default:
neither has run on a TPU here, and jax's is the one tuned and exercised on real TPUs; ours is the one whose
body has executed (in TPU interpret mode, in CI).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

from sgjax.kernels.kv_pool import is_fp8, write_kv
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.pallas_tpu_kernel import sgjax_tpu_attention


def tpu_operands(pool, layer, meta: AttentionMetadata):
    """(kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) for the op, reading `layer` in place."""
    num_layers, num_pages = pool.shape[:2]
    kv_pages = pool.reshape(num_layers * num_pages, *pool.shape[2:])
    page_indices = meta.page_table.astype(jnp.int32) + jnp.asarray(layer, jnp.int32) * num_pages
    num_seqs = jnp.full((1,), meta.kv_lens.shape[0], jnp.int32)
    return kv_pages, meta.kv_lens.astype(jnp.int32), page_indices, meta.cu_q_lens.astype(jnp.int32), num_seqs


def pallas_tpu_attention(
    q,
    k,
    v,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    op=None,
    num_kv_pages_per_block: int | None = None,
    num_queries_per_block: int | None = None,
    tpu_kernel: str = "jax",
    window=0,
    softcap: float | None = None,
    **config,
):
    """Returns ([T, Hq, D], pool). `op` replaces jax's kernel (tests pass jax's reference of it);
    tpu_kernel="sgjax" runs ours, with `config` (block_q, pages_per_block, interpret). `window` / `softcap` as in
    the ref backend; jax's kernel takes the window as a static int (the layers are unrolled on TPU)."""
    if tpu_kernel == "sgjax":
        return sgjax_tpu_attention(
            q, k, v, pool, layer, meta, sm_scale=sm_scale, window=window, softcap=softcap, **config
        )
    if not isinstance(window, int):
        raise ValueError(
            "jax's TPU ragged paged attention needs a static sliding window (unrolled layers), "
            "got a traced one; tpu_kernel='sgjax' takes either"
        )
    if tpu_kernel != "jax" or config:
        raise ValueError(
            f"tpu_kernel must be 'jax' or 'sgjax' (config {sorted(config)} is for 'sgjax'), got {tpu_kernel!r}"
        )
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    op = op or ragged_paged_attention
    kwargs = {k: x for k, x in (("sliding_window", window), ("soft_cap", softcap)) if x}
    if is_fp8(pool.dtype):  # jax's kernel widens fp8 pages to the queries' dtype given scales (ours: outside it)
        kwargs.update(k_scale=1.0, v_scale=1.0)
    if num_kv_pages_per_block is not None:
        kwargs.update(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block)
    out = op(q, *tpu_operands(pool, layer, meta), sm_scale=sm_scale, **kwargs)
    # The op leaves rows past cu_q_lens[-1] unwritten (uninitialised VMEM); the contract wants them finite.
    real = jnp.arange(q.shape[0]) < meta.cu_q_lens[-1]
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype), pool
