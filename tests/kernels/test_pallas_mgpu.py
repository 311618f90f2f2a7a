"""The Hopper Mosaic GPU prefill kernel (kernels/pallas_mgpu.py) against the numpy attention of test_ref_attention.

Compiled runs need a Hopper GPU (the H200 session runs this file there). On CPU, jax's GPU interpret mode runs
the kernel's TMA copies, barrier protocol, tables, masks, softmax and stores (its two dots as plain dots), and
the lowering to a Mosaic GPU custom call for CUDA, the side-buffer row map and the routing are checked.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import pallas_attention, pallas_mgpu
from sgjax.kernels import ragged_blocks as rb
from sgjax.kernels.kv_pool import write_kv
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.pallas_gpu import pallas_gpu_attention
from tests.kernels.test_fp8_pool import FP8, Fp8Values
from tests.kernels.test_ref_attention import make_case

ON_HOPPER = jax.default_backend() == "gpu" and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="compiles only for a Hopper GPU")

# Ragged batches with 64-row tiles cut at every place: exact multiples, partial last tiles, a
# request shorter than one tile, cached prefixes not on page or tile boundaries, padding rows and
# padding request slots.
CASES = {
    "ragged-prefix": dict(q_lens=[130, 64, 7, 200], prefix_lens=[0, 100, 33, 300], page_size=16, head_dim=128),
    "one-long": dict(q_lens=[1024], prefix_lens=[0], page_size=16, head_dim=128),
    "padded-d64-page8": dict(
        q_lens=[70, 129], prefix_lens=[5, 0], page_size=8, head_dim=64, num_tokens=256, num_reqs=4, pages_per_req=40
    ),
    # sliding windows (the first warpgroup's and the second's first tiles differ, rows see nothing in some tiles)
    # and Gemma's head_dim 256 (64-key tiles) with a soft cap
    "window-prefix": dict(
        q_lens=[130, 64, 7, 200], prefix_lens=[0, 100, 33, 300], page_size=16, head_dim=128, window=100
    ),
    "window-softcap-d256": dict(
        q_lens=[300, 40], prefix_lens=[50, 0], page_size=16, head_dim=256, window=128, softcap=50.0
    ),
}
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1)}


def _bf16_case(case, heads, seed):
    args, expected, total = make_case(
        np.random.default_rng(seed), num_heads=heads[0], num_kv_heads=heads[1], **CASES[case]
    )
    q, k, v, pool, layer, meta = args
    q, k, v, pool = (x.astype(jnp.bfloat16) for x in (q, k, v, pool))
    return (q, k, v, pool, layer, meta), expected, total


def _rel_err(out, expected, total):
    out = np.asarray(out, np.float32)[:total]
    return float(np.linalg.norm(out - expected[:total]) / np.linalg.norm(expected[:total]))


@needs_hopper
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_kernel_matches_expectation(case, heads):
    (q, k, v, pool, layer, meta), expected, total = _bf16_case(case, HEADS[heads], seed=len(case) + len(heads))
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    masks = {k: CASES[case][k] for k in ("window", "softcap") if k in CASES[case]}
    fn = jax.jit(functools.partial(pallas_mgpu.mgpu_prefill_attention, sm_scale=q.shape[-1] ** -0.5, **masks))
    for _ in range(2):  # a race shows as a result that moves between runs
        out = np.asarray(fn(q, pool, layer, meta), np.float32)
        assert np.isfinite(out).all()  # padding rows too
        assert _rel_err(out, expected, total) < 1e-2
        np.testing.assert_array_equal(out[total:], 0.0)


def _fp8_case(cases, case, heads, fmt, seed):
    """bf16 queries over an fp8 pool whose keys and values are fp8 values: the expectation is exact in them."""
    args, expected, total = make_case(
        Fp8Values(seed, FP8[fmt]), num_heads=heads[0], num_kv_heads=heads[1], **cases[case]
    )
    q, k, v, pool, layer, meta = args
    return (q.astype(jnp.bfloat16), k, v, pool.astype(FP8[fmt]), layer, meta), expected, total


# Small enough for the interpreter (a thread per warpgroup, every op a callback): ~20-30 s each on 2 cores.
INTERPRET_CASES = {
    # page 8, 13 padding rows and an empty request slot
    "padded-page8": dict(
        q_lens=[70, 5], prefix_lens=[3, 0], page_size=8, head_dim=64, num_tokens=88, num_reqs=3, pages_per_req=10
    ),
    # a 20-key window and Gemma 2's soft cap: on a 100-token prefix the first half-block starts at tile 1 and the
    # second at tile 2 (it skips a tile the first needs), the rows' edges move across 64-key tiles so a row may see
    # nothing in its warpgroup's first tile; request 1 starts inside request 0's last block
    "window-softcap": dict(q_lens=[150, 9], prefix_lens=[100, 30], page_size=16, head_dim=64, window=20, softcap=3.0),
}


# The interpreter's time grows with the heads, so each case runs one layout: GQA on the windowed batch (two blocks
# of 128 rows for request 0: the slot ring wraps, the shorter half drains; request 1 starts inside its last block),
# one head on the padded page-8 batch (no window) over an e4m3 pool (each tile widened into the warpgroup's own bf16
# tile, its ring slot freed at once). The compiled tests run every layout, and both fp8 formats, on a Hopper GPU.
@pytest.mark.parametrize("case,heads,fmt", [("padded-page8", (1, 1), "e4m3"), ("window-softcap", (2, 1), None)])
def test_interpret_mode_matches_expectation(case, heads, fmt):
    if fmt:
        (q, k, v, pool, layer, meta), expected, total = _fp8_case(INTERPRET_CASES, case, heads, fmt, seed=11)
    else:
        args, expected, total = make_case(
            np.random.default_rng(11), num_heads=heads[0], num_kv_heads=heads[1], **INTERPRET_CASES[case]
        )
        q, k, v, pool, layer, meta = (x.astype(jnp.bfloat16) if i < 4 else x for i, x in enumerate(args))
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    assert pool.dtype == (FP8[fmt] if fmt else jnp.bfloat16)
    masks = {k: INTERPRET_CASES[case][k] for k in ("window", "softcap") if k in INTERPRET_CASES[case]}
    out = pallas_mgpu.mgpu_prefill_attention(
        q, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5, block_kv=64, stages=2, interpret=True, **masks
    )
    out = np.asarray(out, np.float32)
    assert _rel_err(out, expected, total) < 1e-2
    np.testing.assert_array_equal(out[total:], 0.0)


@needs_hopper
@pytest.mark.parametrize("case", ["ragged-prefix", "padded-d64-page8", "window-prefix"])
@pytest.mark.parametrize("fmt", sorted(FP8))
def test_kernel_reads_an_fp8_pool(case, fmt):
    (q, k, v, pool, layer, meta), expected, total = _fp8_case(CASES, case, HEADS["gqa4"], fmt, seed=len(case))
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    masks = {k: CASES[case][k] for k in ("window", "softcap") if k in CASES[case]}
    fn = jax.jit(functools.partial(pallas_mgpu.mgpu_prefill_attention, sm_scale=q.shape[-1] ** -0.5, **masks))
    assert "mosaic_gpu" in fn.lower(q, pool, layer, meta).as_text()
    for _ in range(2):
        out = np.asarray(fn(q, pool, layer, meta), np.float32)
        assert _rel_err(out, expected, total) < 1e-2
        np.testing.assert_array_equal(out[total:], 0.0)


@needs_hopper
@pytest.mark.parametrize("block_kv,stages", [(64, 2), (128, 3)])
def test_tile_configs(block_kv, stages):
    (q, k, v, pool, layer, meta), expected, total = _bf16_case("ragged-prefix", HEADS["gqa4"], seed=5)
    pool = write_kv(pool, layer, k, v, meta.slot_mapping)
    out = jax.jit(
        functools.partial(
            pallas_mgpu.mgpu_prefill_attention, sm_scale=q.shape[-1] ** -0.5, block_kv=block_kv, stages=stages
        )
    )(q, pool, layer, meta)
    assert _rel_err(out, expected, total) < 1e-2


@needs_hopper
@pytest.mark.parametrize("fmt", [None, "e4m3"])
def test_backend_routes_prefill_to_mgpu(fmt, monkeypatch):
    if fmt:  # an fp8 pool's prefill reaches the Hopper kernel too, once routed there
        monkeypatch.setattr(pallas_mgpu, "ROUTE_FP8_POOLS", True)
        (q, k, v, pool, layer, meta), expected, total = _fp8_case(CASES, "ragged-prefix", HEADS["gqa4"], fmt, seed=9)
    else:
        (q, k, v, pool, layer, meta), expected, total = _bf16_case("ragged-prefix", HEADS["gqa4"], seed=9)
    fn = jax.jit(functools.partial(pallas_attention, sm_scale=q.shape[-1] ** -0.5, prefill_kernel="mgpu"))
    assert "mosaic_gpu" in fn.lower(q, k, v, pool, layer, meta).as_text()
    out, new_pool = fn(q, k, v, pool, layer, meta)
    assert _rel_err(out, expected, total) < 1e-2
    flat = np.asarray(new_pool[layer].astype(jnp.float32)).reshape(-1, 4, q.shape[-1])
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k.astype(jnp.float32))[:total])


# A mixed bucket (96 rows, 5 request slots: fewer than 64 rows per slot): decodes and a short extend beside an
# 80-row extend, a padding row block and an empty slot. The router splits it by request between the two kernels.
MIXED = dict(
    q_lens=[1, 80, 1, 3],
    prefix_lens=[40, 20, 70, 10],
    page_size=16,
    head_dim=64,
    num_tokens=96,
    num_reqs=5,
    pages_per_req=8,
)


def _mixed_case(heads, seed):
    args, expected, total = make_case(np.random.default_rng(seed), num_heads=heads[0], num_kv_heads=heads[1], **MIXED)
    return tuple(x.astype(jnp.bfloat16) if i < 4 else x for i, x in enumerate(args)), expected, total


def test_mixed_bucket_splits_between_kernels_in_interpret_mode():
    # One head: the split is by request, the same for every head, and the interpreter's time grows with the heads
    # (GQA in the Hopper kernel: test_interpret_mode_matches_expectation; in the Triton one: test_pallas_attention).
    (q, k, v, pool, layer, meta), expected, total = _mixed_case((1, 1), seed=4)
    out, _ = pallas_gpu_attention(
        q,
        k,
        v,
        pool,
        layer,
        meta,
        sm_scale=q.shape[-1] ** -0.5,
        prefill_kernel="mgpu",
        interpret=True,
        mgpu=dict(block_kv=64, stages=2),
    )
    out = np.asarray(out, np.float32)
    for rows in ([0], range(1, 81), [81], range(82, 85)):  # each request: a wrong pick or mask shows here
        rows = list(rows)
        np.testing.assert_allclose(out[rows], expected[rows], atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(out[total:], 0.0)


@needs_hopper
def test_mixed_bucket_compiled():
    (q, k, v, pool, layer, meta), expected, total = _mixed_case((8, 2), seed=6)
    fn = jax.jit(functools.partial(pallas_attention, sm_scale=q.shape[-1] ** -0.5, prefill_kernel="mgpu"))
    text = fn.lower(q, k, v, pool, layer, meta).as_text()
    assert "mosaic_gpu" in text and "ragged_paged_attention" in text  # both kernels
    for _ in range(2):
        out = np.asarray(fn(q, k, v, pool, layer, meta)[0], np.float32)
        assert _rel_err(out, expected, total) < 1e-2
        for rows in ([0], [81], [82, 83, 84]):  # the Triton kernel's requests
            assert _rel_err(out[rows], expected[rows], len(rows)) < 1e-2
        np.testing.assert_array_equal(out[total:], 0.0)


@needs_hopper
def test_metadata_sliced_out_of_one_buffer_as_the_engine_packs_it():
    # The engine's step unpacks the metadata from one int32 buffer; a slice at an offset that is not a multiple of
    # 64 ints must still reach the kernel aligned (Mosaic GPU rejects inputs that are not 256-byte aligned).
    (q, k, v, pool, layer, meta), expected, total = _mixed_case((8, 2), seed=8)
    parts = [
        np.zeros(3, np.int32),
        np.asarray(meta.slot_mapping),
        np.asarray(meta.cu_q_lens),
        np.asarray(meta.kv_lens),
        np.asarray(meta.page_table).reshape(-1),
    ]
    packed = jnp.asarray(np.concatenate(parts))
    sizes = np.cumsum([len(x) for x in parts])

    @jax.jit
    def step(packed, q, k, v, pool):
        m = AttentionMetadata(
            slot_mapping=packed[sizes[0] : sizes[1]],
            cu_q_lens=packed[sizes[1] : sizes[2]],
            kv_lens=packed[sizes[2] : sizes[3]],
            page_table=packed[sizes[3] : sizes[4]].reshape(meta.page_table.shape),
        )
        return pallas_attention(q, k, v, pool, layer, m, sm_scale=q.shape[-1] ** -0.5, prefill_kernel="mgpu")[0]

    out = np.asarray(step(packed, q, k, v, pool), np.float32)
    assert _rel_err(out, expected, total) < 1e-2


def test_split_tables_give_each_row_one_kernel():
    cu = jnp.asarray([0, 1, 81, 82, 85, 85], jnp.int32)
    meta = type("M", (), dict(cu_q_lens=cu, kv_lens=jnp.asarray([41, 100, 71, 13, 0], jnp.int32)))
    long_req = np.asarray(rb.long_requests(meta, 64))
    np.testing.assert_array_equal(long_req, [False, True, False, False, False, True])  # the padding is long
    row_long = np.asarray(rb.row_mask(meta, 96, jnp.asarray(long_req)))
    np.testing.assert_array_equal(np.flatnonzero(~row_long), [0, 81, 82, 83, 84])
    for include, block, align in ((long_req, 128, 8), (~long_req, 4, 1)):
        table, first = (np.asarray(x) for x in rb.aligned_block_table(meta, 96, block, align, jnp.asarray(include)))
        covered = np.zeros(96, bool)
        for (start, end, _, _), lo in zip(table, first):
            rows = np.arange(max(start, lo), min(start + block, end))
            assert not covered[rows].any()
            covered[rows] = True
        np.testing.assert_array_equal(covered, row_long if include[-1] else ~row_long)


def test_lowers_to_a_mosaic_gpu_call_for_cuda():
    (q, k, v, pool, layer, meta), _, _ = _bf16_case("ragged-prefix", HEADS["gqa4"], seed=1)
    fn = jax.jit(functools.partial(pallas_mgpu.mgpu_prefill_attention, sm_scale=0.1))
    text = jax.export.export(fn, platforms=["cuda"])(q, pool, layer, meta).mlir_module()
    assert "mosaic_gpu" in text


def test_side_rows_map_each_partial_tile_once():
    # Requests of 130 (two whole tiles and 2 rows), 64 rows from row 130 (tiles from 128: a partial first and
    # last tile), 7 rows, an empty slot, then 55 padding rows to 256.
    cu = jnp.asarray([0, 130, 194, 201, 201], jnp.int32)
    meta = type("M", (), dict(cu_q_lens=cu))
    rows = np.asarray(pallas_mgpu._side_rows(meta, num_rows=256, block_q=64)).reshape(5, 2, 64)
    drop = 256
    assert (rows[0, 0] == drop).all()  # request 0 starts on a tile boundary: no front slot
    np.testing.assert_array_equal(rows[0, 1, :2], [128, 129])
    assert (rows[0, 1, 2:] == drop).all()
    np.testing.assert_array_equal(rows[1, 0, :2], drop)  # rows 128-129 belong to request 0
    np.testing.assert_array_equal(rows[1, 0, 2:], np.arange(130, 192))
    np.testing.assert_array_equal(rows[1, 1, :2], [192, 193])  # its last tile starts at 192
    assert (rows[1, 1, 2:] == drop).all()
    np.testing.assert_array_equal(rows[2, 0, :2], drop)  # tile from 192: rows 194-200 are request 2's
    np.testing.assert_array_equal(rows[2, 0, 2:9], np.arange(194, 201))
    assert (rows[2, 1] == drop).all()  # one tile, already in the front slot
    assert (rows[3] == drop).all()  # an empty request slot has no rows
    np.testing.assert_array_equal(rows[4, 0, 1:56], np.arange(201, 256))  # the padding, from row 200
    assert rows[4, 0, 0] == drop and (rows[4, 1] == drop).all()
    # Every row below 256 appears at most once across the slots.
    real = rows[rows < drop]
    assert len(real) == len(set(real.tolist()))


def test_aligned_blocks_cover_each_row_once():
    cu = jnp.asarray([0, 130, 194, 201, 201], jnp.int32)
    meta = type("M", (), dict(cu_q_lens=cu, kv_lens=jnp.asarray([130, 100, 7, 0], jnp.int32)))
    table, first = (np.asarray(x) for x in rb.aligned_block_table(meta, 256, 128, 8))
    owner = np.full(256, -1)
    for (start, end, _, _), lo in zip(table, first):
        assert start % 8 == 0 and lo - 8 < start + 128
        rows = np.arange(max(start, lo), min(start + 128, end))
        assert (owner[rows] == -1).all()
        owner[rows] = 1
    assert (owner == 1).all()


def test_supported_shapes():
    assert pallas_mgpu.supported(jnp.bfloat16, 128, 16) and pallas_mgpu.supported(jnp.float16, 64, 8)
    assert not pallas_mgpu.supported(jnp.float32, 128, 16)  # the Triton kernel keeps fp32
    assert not pallas_mgpu.supported(jnp.bfloat16, 96, 16) and not pallas_mgpu.supported(jnp.bfloat16, 128, 4)
    # 128-key tiles: 3 deep fit in shared memory at head_dim 128 (measured: 4 deep did not), none at 256, where
    # the default falls back to 64-key tiles 2 deep (Gemma's head_dim)
    assert pallas_mgpu._stages(64, 128, 128) == 3 and not pallas_mgpu.supported(jnp.bfloat16, 256, 16, block_kv=128)
    assert pallas_mgpu.default_block_kv(256) == 64 and pallas_mgpu._stages(64, 64, 256) == 2
    assert pallas_mgpu.supported(jnp.bfloat16, 256, 16) and pallas_mgpu.default_block_kv(128) == 128
    # an fp8 pool: a ring of half the bytes plus each compute warpgroup's widened K and V tiles
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    assert pallas_mgpu.supported(jnp.bfloat16, 128, 16, kv_dtype=e4m3) and pallas_mgpu._stages(64, 128, 128, True) == 2
    assert pallas_mgpu.supported(jnp.bfloat16, 64, 8, kv_dtype=e5m2)
    assert pallas_mgpu.default_block_kv(128, wide=True) == 128
    assert not pallas_mgpu.supported(jnp.bfloat16, 128, 16, kv_dtype=jnp.int8)
    assert not pallas_mgpu.supported(jnp.bfloat16, 256, 16, kv_dtype=e4m3)  # Gemma's fp8 pool: the Triton kernel


def test_unknown_prefill_kernel_is_rejected():
    (q, k, v, pool, layer, meta), _, _ = _bf16_case("padded-d64-page8", HEADS["gqa4"], seed=2)
    with pytest.raises(ValueError, match="prefill_kernel"):
        pallas_attention(q, k, v, pool, layer, meta, sm_scale=0.1, prefill_kernel="cuda")
