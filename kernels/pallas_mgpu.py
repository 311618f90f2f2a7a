"""Ragged paged prefill attention for Hopper in Pallas-Mosaic GPU (installed as sgjax.kernels.pallas_mgpu).

The Triton kernel (pallas_gpu) tops out near 30 % of the bf16 matmul rate on a 4k prefill: Triton
gives no control over TMA, warpgroup MMAs or warp specialisation. This kernel is FlashAttention-3's
forward in Mosaic GPU, over our paged pool:
- one CTA per (query block of 2 x block_q rows of one request, query head); three warpgroups: two
  compute the two halves of the rows, one only issues TMA copies of K and V tiles into a ring of
  `stages` shared-memory slots (warp specialisation, so loads never wait behind math);
- a K/V tile of block_kv keys is gathered page by page: one TMA copy of page_size rows per page,
  all completing on one barrier that expects every page's arrival;
- the two compute warpgroups take turns on the tensor cores (a shared "schedule" barrier): while one
  runs its QK^T and PV wgmmas, the other does its softmax (FA3's ping-pong);
- causal masking only on tiles that reach past a row block's first position, like pallas_gpu;
- a sliding window (a traced per-layer width, 0: none) starts each warpgroup at the first tile its first row sees
  and masks every tile (the window's edge moves by row); a soft cap (Gemma 2) is a tanh on the scores.

TMA row offsets must be multiples of 8, so a request's blocks start at its first row rounded down to 8
(ragged_blocks.aligned_block_table) and may compute a few rows of the previous request. A 64-row tile wholly
inside its request is stored straight into the output; a partial one (a request's first or last tile) goes to
a side buffer, two slots per request, and XLA scatters those few rows (at most 2 (R + 1) tiles), so no CTA
ever writes rows of another request.

Only for prefill-shaped requests: a decode row would still cost a whole tile of tensor-core rows, so a mixed
bucket gives this kernel only its long requests (`include`) and its decodes to the Triton kernel (pallas_gpu).
Needs bf16 or fp16 queries, head_dim a multiple of 64, page_size a multiple of 8 dividing block_kv. An fp8
pool (e4m3 / e5m2) is copied to shared memory as its bytes, and each compute warpgroup widens a tile to the queries'
dtype in its own shared memory before its dots (wgmma takes fp8 only with both operands fp8), freeing the ring slot
at once; the ring is half as large, so 128-key tiles fit 2 deep at head_dim 128 (pallas_gpu routes an fp8 pool
here once ROUTE_FP8_POOLS says the compiled kernel was checked). On the H200 a long
prefill took about 60% of the Triton kernel's time (docs/journal/kernels-h200.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sgjax.kernels import ragged_blocks as rb
from sgjax.kernels.metadata import AttentionMetadata

_LOG2E = math.log2(math.e)
_MASK = -1e30  # a masked score where a whole row may be masked (finite: see _kernel's step)
_FIRST_ROW = rb.NUM_FIELDS  # the extra column: the first row of the block's request
_FIELDS = rb.NUM_FIELDS + 1
_ALIGN = 8  # TMA copies into (8, 64)-tiled shared memory need row offsets that are multiples of 8


def _plgpu():
    # Imported on use: jax 0.10/0.11 CPU wheels have the module, but nothing here runs without a Hopper GPU.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _kernel(
    blk_ref,
    scal_ref,
    pt_ref,
    q_ref,
    kv_ref,
    out_ref,
    side_ref,
    scoped,
    *,
    block_q,
    block_kv,
    stages,
    page_size,
    pages_per_req,
    pages_per_layer,
    group,
    num_blocks,
    scale,
    interpret,
    windowed,
    softcap,
):
    plgpu = _plgpu()
    (qo_smem2, k_smem, v_smem, *wide), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
    b = num_blocks - 1 - lax.axis_index("blocks")  # the longest (last) blocks of a request start first
    head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    # The block table is flat, _FIELDS per block: scalar loads at one index lower on every jax version.
    row_start, row_end = blk_ref[b * _FIELDS + rb.ROW_START], blk_ref[b * _FIELDS + rb.ROW_END]
    pos_offset, req = blk_ref[b * _FIELDS + rb.POS_OFFSET], blk_ref[b * _FIELDS + rb.REQUEST]
    first_row = blk_ref[b * _FIELDS + _FIRST_ROW]  # row_start may be up to 7 rows below it (8-row TMA tiles)
    layer, real_rows = scal_ref[0], scal_ref[1]
    kv_head = lax.div(head, jnp.int32(group))
    window = scal_ref[2] if windowed else 0  # a row at p sees keys (p - window, p]; 0: all up to p

    def first_tile(row):
        """The first KV tile row `row` (and so every later row) sees: 0 without a window. Rows below the request's
        first row (TMA alignment) belong to the previous request and are discarded, so they do not count."""
        if not windowed:
            return 0
        edge = jnp.maximum(jnp.maximum(row, first_row) + pos_offset - window + 1, 0)
        return jnp.where(window > 0, lax.div(edge, jnp.int32(block_kv)), 0)

    def steps_for(lo, hi):
        """KV tiles that rows [lo, hi) attend (0 when the range is empty)."""
        kv_end = jnp.maximum(jnp.minimum(hi, row_end) + pos_offset, 0)
        return jnp.where(hi > lo, pl.cdiv(kv_end, jnp.int32(block_kv)), 0)

    # Every tile the memory warpgroup loads must be waited on by a compute warpgroup before its slot is reloaded
    # (a barrier re-armed before its phase completed hangs), so it loads exactly what the longer half needs.
    block_steps = steps_for(row_start, row_start + 2 * block_q)
    # The memory warpgroup loads tiles [block_first, block_steps); the ring's slot counts from block_first.
    block_first = jnp.minimum(first_tile(row_start), block_steps) if windowed else 0

    def slot_of(kv_step):
        return lax.rem(kv_step - block_first if windowed else kv_step, jnp.int32(stages))

    # In jax's GPU interpret mode (CPU, tests) there are no register layouts, and its wgmma takes neither a
    # transposed B nor a register A: the two dots read the same smem tiles as plain dots there. Everything else
    # (TMA page copies, the barrier protocol, tables, masks, softmax, stores) is the compiled kernel's own code.
    def layout(x, to):
        return x if interpret else plgpu.layout_cast(x, to)

    def iota(shape, dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def dot(a, b, dims):
        return lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)

    def sched_barrier():
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def widened(ring, slot, free, which):
        """The ring's tile for the dots: an fp8 pool's tile is widened into this warpgroup's own q-dtype tile (the
        tensor cores take fp8 only with both operands fp8), and the ring slot is freed as soon as it is read."""
        if not wide:
            return ring.at[slot]
        dst = wide[which].at[wg]
        for i in range(block_kv // 64):  # 64-row strips bound the registers a strip's widening holds
            rows = (pl.ds(i * 64, 64), slice(None))
            if interpret:
                x = ring.at[slot][rows]
            else:
                x = plgpu.load(ring.at[slot], rows, layout=plgpu.Layout.WGMMA_UPCAST_2X)
            # e4m3 and e5m2 are exact in f16 and in the bf16 queries (PTX converts fp8 only to f16 before ISA 9.2)
            x = x.astype(jnp.float16).astype(jnp.float32).astype(dst.dtype)
            dst.at[rows[0]][...] = layout(x, plgpu.Layout.WGMMA)
        plgpu.barrier_arrive(free.at[slot])
        plgpu.commit_smem()  # the stores reach the wgmma's (async proxy) view of shared memory
        return dst

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo_smem = qo_smem2.at[wg]
        row0 = pl.multiple_of(row_start + wg * block_q, _ALIGN)
        row_hi = jnp.minimum(row0 + block_q, row_end)
        kv_steps = steps_for(row0, row_hi)
        # Tiles wholly at or below the first row's position need no mask; with a window every tile does.
        full_steps = jnp.clip(lax.div(row0 + pos_offset + 1, jnp.int32(block_kv)), 0, kv_steps)
        if windowed:
            own_first = jnp.clip(first_tile(row0), block_first, jnp.maximum(kv_steps, block_first))
            kv_steps = jnp.maximum(kv_steps, own_first)
            full_steps = jnp.where(window > 0, own_first, full_steps)
        else:
            own_first = 0

        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, block_q), head], qo_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        m_i = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = layout(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = layout(jnp.full((block_q, q_ref.shape[-1]), 0, jnp.float32), plgpu.Layout.WGMMA)

        pl.when(wg == 1)(sched_barrier)  # offsets the two warpgroups by half a step

        def skip(kv_step, _, wait):
            # A tile the other warpgroup needs: free its slot and keep the ping-pong in step. `wait`: observe its
            # loads too, as a tile below this warpgroup's window comes before tiles it waits on, and a barrier's
            # phase is tracked by the waits (the interpreter also insists on every phase being observed).
            slot = slot_of(kv_step)
            if wait or interpret:
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            sched_barrier()
            sched_barrier()

        if windowed:
            lax.fori_loop(block_first, own_first, functools.partial(skip, wait=True), None)

        @pl.when(kv_steps > own_first)
        def _():
            plgpu.barrier_wait(k_bar.at[slot_of(own_first)])

        def step(kv_step, carry, masked):
            acc, m_i, l_i = carry
            slot = slot_of(kv_step)

            k_tile = widened(k_smem, slot, k_free, 0)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                sched_barrier()
                return acc_ref[...]

            if interpret:
                s = dot(qo_smem[...], k_tile[...], ((1,), (1,)))
                sched_barrier()
            else:
                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
            if not wide:
                plgpu.barrier_arrive(k_free.at[slot])
            if softcap:  # in log2 units: softcap * tanh(natural score / softcap) * log2(e)
                s = (softcap * _LOG2E) * jnp.tanh(s * (scale / _LOG2E / softcap))

            def scaled(x):  # without a cap the scale is applied after the row max: one FMA per element
                return x if softcap else x * scale

            valid = None
            if masked:
                rows, keys = iota(s.shape, 0), iota(s.shape, 1)
                pos, key = rows + (row0 + pos_offset), keys + kv_step * block_kv
                valid = pos >= key
                if windowed:  # no window: an edge below every position (no scalar-bool broadcast in the kernel)
                    valid = valid & (key > pos - jnp.where(window > 0, window, jnp.int32(1 << 30)))
                # With a window a row may see nothing in its first tiles: a finite mask keeps m finite there
                # (-inf - -inf is NaN), and p is zeroed below.
                s = jnp.where(valid, s, _MASK if windowed else -jnp.inf)
            # m is kept in log2 units times the scale, so p is one FMA and an exp2 per element.
            m_new = jnp.maximum(m_i, scaled(s.max(axis=1)))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if windowed and masked:
                p = jnp.where(valid, p, 0.0)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l_i = l_i * alpha + p.sum(axis=1)
            p16 = p.astype(q_ref.dtype)
            acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            plgpu.barrier_arrive(sched)  # softmax done
            plgpu.barrier_wait(v_bar.at[slot])
            v_tile = widened(v_smem, slot, v_free, 1)  # while the other warpgroup has the tensor cores
            plgpu.barrier_wait(sched)  # the tensor cores are ours again

            def wait_next_k():
                @pl.when(kv_step + 1 < kv_steps)
                def _():
                    plgpu.barrier_wait(k_bar.at[slot_of(kv_step + 1)])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_tile)  # P from registers, as FA3
                wait_next_k()

            if interpret:
                acc = acc + dot(p16, v_tile[...], ((1,), (0,)))
                wait_next_k()
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            if not wide:
                plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        carry = lax.fori_loop(own_first, full_steps, functools.partial(step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True), carry)
        lax.fori_loop(kv_steps, block_steps, functools.partial(skip, wait=False), None)
        pl.when(wg == 0)(sched_barrier)

        # Rows with no key (padding, empty tiles) have l = 0: write zeros, not 0/0.
        l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
        acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        qo_smem[...] = acc.astype(qo_smem.dtype)
        plgpu.commit_smem()
        whole = (row0 >= first_row) & (row0 + block_q <= row_end)

        @pl.when(whole)
        def _():
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[pl.ds(row0, block_q), head])

        @pl.when(~whole & (row0 < row_end))
        def _():
            # Slots 2s (a tile starting below the first row) and 2s + 1 (the last tile) of request s; the
            # padding rows are s = R.
            s = jnp.where(first_row >= real_rows, side_ref.shape[0] // 2 - 1, req)
            plgpu.copy_smem_to_gmem(qo_smem, side_ref.at[2 * s + (row0 >= first_row).astype(jnp.int32), :, head])

        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        base = (layer * pages_per_layer) * page_size

        def load(kv_step, slot):
            kv_step = kv_step + block_first  # the ring's step -> the tile
            for i in range(block_kv // page_size):
                idx = jnp.minimum(kv_step * (block_kv // page_size) + i, pages_per_req - 1)
                first = pl.multiple_of(base + pt_ref[req * pages_per_req + idx] * page_size, _ALIGN)
                rows = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(
                    kv_ref.at[pl.ds(first, page_size), 2 * kv_head], k_smem.at[slot, rows], k_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    kv_ref.at[pl.ds(first, page_size), 2 * kv_head + 1], v_smem.at[slot, rows], v_bar.at[slot]
                )

        num_steps = block_steps - block_first
        for i in range(stages):
            pl.when(i < num_steps)(functools.partial(load, i, i))

        @pl.loop(0, jnp.maximum(num_steps - stages, 0))
        def _(kv_step):
            slot = lax.rem(kv_step, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            load(kv_step + stages, slot)

        if interpret:  # observe the last releases too (see skip)

            @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
            def _(kv_step):
                plgpu.barrier_wait(k_free.at[lax.rem(kv_step, jnp.int32(stages))])
                plgpu.barrier_wait(v_free.at[lax.rem(kv_step, jnp.int32(stages))])


_SMEM_BYTES = 227 * 1024  # shared memory a Hopper CTA may use


def _smem_bytes(block_q: int, block_kv: int, head_dim: int, stages: int, wide: bool = False) -> int:
    """The q/out tiles, the K/V ring (fp8 where `wide`) and, for an fp8 pool, each compute warpgroup's widened K
    and V tiles, plus barriers."""
    ring = 2 * stages * block_kv * head_dim * (1 if wide else 2)
    widened = 2 * 2 * block_kv * head_dim * 2 if wide else 0
    return 2 * 2 * block_q * head_dim + ring + widened + 1024


def _stages(block_q: int, block_kv: int, head_dim: int, wide: bool = False) -> int:
    """The deepest K/V ring (3 was the best depth in the H200 sweep, 2 the least that overlaps) that fits in shared
    memory, 0 if none."""
    return next((s for s in (3, 2) if _smem_bytes(block_q, block_kv, head_dim, s, wide) <= _SMEM_BYTES), 0)


def default_block_kv(head_dim: int, block_q: int = 64, wide: bool = False) -> int:
    """128-key tiles (the H200 sweep's best at head_dim 128), else 64 where those do not fit (head_dim 256)."""
    return 128 if _stages(block_q, 128, head_dim, wide) else 64


FP8_POOLS = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# The fp8 widening has run in jax's GPU interpret mode only: pallas_gpu keeps an fp8 pool's prefill on the Triton
# kernel until the compiled cases (test_kernel_reads_an_fp8_pool) have passed on a Hopper GPU and its speed against
# Triton's is measured (docs/bench.md); then this becomes True.
ROUTE_FP8_POOLS = False


def _widens(q_dtype, kv_dtype) -> bool:
    return kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(q_dtype)


def supported(
    q_dtype, head_dim: int, page_size: int, block_kv: int | None = None, block_q: int = 64, kv_dtype=None
) -> bool:
    """Whether this kernel handles the shapes (the caller falls back to the Triton kernel otherwise). `kv_dtype`
    (None: the queries'): the pool's, the queries' or fp8 (e4m3 / e5m2, widened tile by tile in shared memory)."""
    wide = _widens(q_dtype, kv_dtype)
    block_kv = block_kv or default_block_kv(head_dim, block_q, wide)
    return (
        jnp.dtype(q_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and (not wide or jnp.dtype(kv_dtype) in FP8_POOLS)
        and head_dim % 64 == 0
        and page_size % 8 == 0
        and block_kv % page_size == 0
        and (not wide or block_kv % 64 == 0)
        and _stages(block_q, block_kv, head_dim, wide) > 0
    )


def _tiles(dtype, head_dim: int):
    """Shared-memory transforms for [rows, head_dim] tiles: 128-byte swizzled rows, or the row's bytes if fewer."""
    plgpu = _plgpu()
    swizzle = min(128, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def mgpu_prefill_attention(
    q,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    block_q: int = 64,
    block_kv: int | None = None,
    stages: int | None = None,
    interpret: bool = False,
    include=None,
    window=0,
    softcap: float | None = None,
):
    """Attention of q [T, Hq, D] over the pool (the new K/V already written). Returns [T, Hq, D].

    Defaults from the H200 sweep (docs/journal/kernels-h200.md): 128-key tiles 3 deep (224 KB of shared memory at
    D 128) beat 2 deep and 64-key tiles.
    `block_kv` None: 128, or 64 where 128-key tiles do not fit in shared memory (head_dim 256, Gemma). `stages`
    None: 3, or 2 where 3 would not fit. `interpret`: run in jax's GPU interpret mode on the CPU (tests; the two
    dots become plain dots there, see _kernel). `include` (bool[R + 1], the last entry the padding rows): compute
    only those requests; the other rows of the result are undefined. `window` (an int or traced int32, 0: none)
    and `softcap` as in the ref backend."""
    plgpu = _plgpu()
    (num_rows, num_heads, head_dim, num_layers, num_pages, page_size, num_kv_heads, group, num_reqs, pages_per_req) = (
        rb.batch_dims(q, pool, meta)
    )
    wide = _widens(q.dtype, pool.dtype)
    block_kv = block_kv or default_block_kv(head_dim, block_q, wide)
    if not supported(q.dtype, head_dim, page_size, block_kv, block_q, pool.dtype):
        raise ValueError(
            f"mgpu prefill attention needs bf16/fp16 queries over a pool of theirs or an fp8 dtype, head_dim % 64 "
            f"== 0, page_size % 8 == 0 dividing block_kv, and tiles that fit in shared memory; got {q.dtype} over "
            f"{pool.dtype}, D {head_dim}, page {page_size}, block_kv {block_kv}"
        )
    stages = stages or _stages(block_q, block_kv, head_dim, wide)
    blocks, first_rows = rb.aligned_block_table(meta, num_rows, 2 * block_q, _ALIGN, include)
    num_blocks = blocks.shape[0]
    blocks = jnp.concatenate([blocks, first_rows[:, None]], axis=1).reshape(-1)
    dtype = q.dtype
    tiles, ring_tiles = _tiles(dtype, head_dim), _tiles(pool.dtype, head_dim)
    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        block_kv=block_kv,
        stages=stages,
        page_size=page_size,
        pages_per_req=pages_per_req,
        pages_per_layer=num_pages,
        group=group,
        num_blocks=num_blocks,
        scale=sm_scale * _LOG2E,
        interpret=interpret,
        windowed=not (isinstance(window, int) and window == 0),
        softcap=softcap,
    )

    def entry(blk_ref, scal_ref, pt_ref, q_ref, kv_ref, out_ref, side_ref):
        pl.run_scoped(
            lambda *scoped: kernel(blk_ref, scal_ref, pt_ref, q_ref, kv_ref, out_ref, side_ref, scoped),
            (
                plgpu.SMEM((2, block_q, head_dim), dtype, transforms=tiles),
                plgpu.SMEM((stages, block_kv, head_dim), pool.dtype, transforms=ring_tiles),
                plgpu.SMEM((stages, block_kv, head_dim), pool.dtype, transforms=ring_tiles),
                *[plgpu.SMEM((2, block_kv, head_dim), dtype, transforms=tiles) for _ in range(2 if wide else 0)],
            ),
            (
                plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
                plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
                plgpu.Barrier(num_barriers=2),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    # TMA copies into 8-row smem tiles need the row count of q and out to be a multiple of 8.
    padded_rows = -(-num_rows // 8) * 8
    if padded_rows != num_rows:
        q = jnp.pad(q, ((0, padded_rows - num_rows), (0, 0), (0, 0)))
    if interpret:  # the hardware zero-fills a TMA read past the end; the interpreter raises instead
        q = jnp.pad(q, ((0, 2 * block_q), (0, 0), (0, 0)))
    scalars = jnp.stack(
        [
            jnp.asarray(layer, jnp.int32).reshape(()),
            meta.cu_q_lens[-1].astype(jnp.int32),
            jnp.asarray(window, jnp.int32).reshape(()),
        ]
    )
    # A Mosaic GPU call rejects inputs that are not 256-byte aligned ("Input buffer 2 is not 256-byte aligned" in
    # the engine on the H200). The engine unpacks its metadata from one packed step buffer, and XLA hands a slice of
    # a buffer to a custom call as an offset into it; an elementwise op (page ids are >= 0) gives the table a buffer
    # of its own. The other inputs are already computed here (blocks, scalars) or come out of the model (q).
    page_table = jnp.maximum(meta.page_table.reshape(-1).astype(jnp.int32), 0)
    out, side = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((padded_rows, num_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((2 * (num_reqs + 1), block_q, num_heads, head_dim), dtype),
        ),
        grid=(num_heads, num_blocks),
        grid_names=("heads", "blocks"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **_interpret_kwargs(interpret),
    )(blocks, scalars, page_table, q, pool.reshape(num_layers * num_pages * page_size, 2 * num_kv_heads, head_dim))
    dst = _side_rows(meta, num_rows, block_q)
    dst = jnp.where(dst < num_rows, dst, padded_rows)  # out of bounds even when q was padded: dropped
    out = out.at[dst].set(side.reshape(-1, num_heads, head_dim), mode="drop")
    return out[:num_rows]


def _interpret_kwargs(interpret: bool) -> dict:
    if not interpret:
        return {}
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # not public in jax 0.10/0.11

    return dict(interpret=InterpretGPUParams())


def _side_rows(meta: AttentionMetadata, num_rows: int, block_q: int):
    """i32[2 (R + 1) block_q]: the output row of each side-buffer row, num_rows (dropped) where none.

    Request s (s = R: the padding rows) has tiles of block_q rows from its first row rounded down to a multiple of
    8. Slot 2s holds its first tile when that starts below the first row; slot 2s + 1 its last tile when that ends
    past the request and starts at or above the first row (otherwise the kernel stored it straight)."""
    cu = meta.cu_q_lens.astype(jnp.int32)
    first = cu
    ends = jnp.concatenate([cu[1:], jnp.full((1,), num_rows, jnp.int32)])
    aligned = first - first % _ALIGN
    last = aligned + jnp.maximum(ends - 1 - aligned, 0) // block_q * block_q
    i = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    front = aligned[:, None] + i
    front_ok = (first % _ALIGN != 0)[:, None] & (front >= first[:, None]) & (front < ends[:, None])
    back = last[:, None] + i
    back_ok = ((last >= first) & (ends > first) & (ends < last + block_q))[:, None] & (back < ends[:, None])
    rows = jnp.stack([jnp.where(front_ok, front, num_rows), jnp.where(back_ok, back, num_rows)], axis=1)
    return rows.reshape(-1)
