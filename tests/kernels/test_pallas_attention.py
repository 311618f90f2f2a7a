"""The `pallas` backend against the per-request numpy attention of test_ref_attention.

On CPU the GPU kernel runs in Pallas interpret mode (the same kernel body, executed op by op);
on a GPU the same tests run the Triton-compiled kernel. Grids stay tiny so CI stays fast.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import BACKENDS, default_backend, get_backend, pallas_attention, ref_attention
from sgjax.kernels import ragged_blocks as rb
from sgjax.kernels.pallas_gpu import default_config
from tests.kernels.test_ref_attention import CASES, WINDOWED, make_case, windowed_args

ON_GPU = jax.default_backend() == "gpu"
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "gqa8": (8, 1)}

# Shapes the contract cases do not reach: pages crossed by every request, a long context split
# into many key tiles, head_dim 64/128, page sizes 8 and 16, a non-power-of-two group.
EXTRA = {
    "long-context": dict(q_lens=[1, 3, 1], prefix_lens=[700, 250, 31], page_size=16, head_dim=64),
    "page-crossing": dict(q_lens=[7, 9, 1], prefix_lens=[5, 14, 8], page_size=8, head_dim=128),
}


def _run(args, attend=pallas_attention, **config):
    q, k, v, pool, layer, meta = args
    attend = jax.jit(functools.partial(attend, sm_scale=q.shape[-1] ** -0.5, **config))
    out, new_pool = attend(q, k, v, pool, layer, meta)
    return np.asarray(out), np.asarray(new_pool)


def _check(case, heads, tol=2e-5, attend=pallas_attention, **config):
    """The backend `attend` on a contract case: outputs, finite padded rows, the new K/V in place."""
    rng = np.random.default_rng(sum(map(ord, case)))
    spec = {**CASES, **EXTRA}[case]
    args, expected, total = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], **spec)
    out, new_pool = _run(args, attend, **config)
    tol = tol * (5 if ON_GPU else 1)  # ex2.approx on the GPU
    np.testing.assert_allclose(out[:total], expected[:total], atol=tol, rtol=tol)
    assert np.isfinite(out).all()  # padded rows too
    q, k, v, pool, layer, meta = args
    flat = new_pool[layer].reshape(-1, 2 * heads[1], q.shape[-1])
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k)[:total])
    np.testing.assert_array_equal(flat[slots, 1::2], np.asarray(v)[:total])
    np.testing.assert_array_equal(new_pool[0], np.asarray(pool)[0])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_contract_cases(case, heads):
    _check(case, HEADS[heads])


@pytest.mark.parametrize("case", sorted(EXTRA))
def test_long_and_page_crossing(case):
    _check(case, HEADS["gqa4"])


@pytest.mark.parametrize(
    "case,config",
    [
        ("mixed", dict(num_splits=2, block_k=8)),
        ("mixed", dict(num_splits=1, block_k=8, prefetch_pages=True)),  # pages of the next tile in the carry
        ("prefix-hit-long", dict(num_splits=4, block_k=16)),  # some splits see no key of short requests
        ("all-prefill", dict(num_splits=2, block_q=2, block_k=4)),  # block_k below the page size
        ("long-context", dict(num_splits=8, block_k=32, prefetch_pages=True)),
    ],
)
def test_split_k_and_tiles(case, config):
    _check(case, HEADS["gqa4"], **config)


def test_group_not_power_of_two():
    # Qwen2-0.5B has 14 query heads on 2 KV heads: the wrapper pads each group to a power of two.
    _check("mixed", (6, 2))


def test_bf16_matches_fp32_expectation():
    rng = np.random.default_rng(7)
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **EXTRA["page-crossing"] | dict(head_dim=64))
    bf16 = [a.astype(jnp.bfloat16) if i < 4 else a for i, a in enumerate(args)]
    out, _ = _run(bf16)
    assert out.dtype == jnp.bfloat16
    out = out.astype(np.float32)[:total]
    err = np.linalg.norm(out - expected[:total]) / np.linalg.norm(expected[:total])
    assert err < 1e-2


def test_block_table_covers_each_row_once():
    rng = np.random.default_rng(3)
    args, _, total = make_case(rng, num_heads=4, num_kv_heads=2, **CASES["padded"])
    meta = args[-1]
    num_rows = args[0].shape[0]
    for block_q in (1, 2, 4, 8):
        table = np.asarray(rb.block_table(meta, num_rows, block_q))
        owner = np.full(num_rows, -1)
        for start, end, offset, req in table:
            rows = np.arange(start, min(start + block_q, end))
            assert (owner[rows] == -1).all()
            owner[rows] = req
            if rows.size and rows[0] < total:  # real rows: pos = row + offset ends at kv_len - 1
                assert rows[-1] + offset < np.asarray(meta.kv_lens)[req]
            elif rows.size:  # padding rows have negative positions, so they see no key
                assert rows[-1] + offset < 0
        assert (owner >= 0).all()
        assert len(table) == rb.num_blocks(num_rows, meta.kv_lens.shape[0], block_q)


def test_default_backend_and_registry():
    assert default_backend("cpu") == "cpu"  # the native kernel (tests/kernels/test_cpu_attention.py)
    assert default_backend("gpu") == "pallas" and default_backend("tpu") == "pallas"
    assert get_backend("pallas") is pallas_attention and BACKENDS["ref"] is ref_attention


def test_default_config_fills_the_gpu():
    # Llama-3-8B shapes: decode of one 16k request splits its keys, a 4k prefill does not.
    one = default_config(num_rows=1, num_reqs=1, group=4, num_kv_heads=8, context=16384)
    assert one["num_splits"] == 32 and one["block_q"] * 4 == 16
    prefill = default_config(num_rows=4096, num_reqs=1, group=4, num_kv_heads=8, context=4096)
    assert prefill["num_splits"] == 1 and prefill["block_q"] * 4 == 64
    short = default_config(num_rows=1, num_reqs=1, group=4, num_kv_heads=8, context=256)
    assert short["num_splits"] == 1  # one 64-key tile per split would be all overhead


def check_windowed(case, attend, tol=2e-5, jit=True, **config):
    """A backend on a sliding-window / soft-cap case against the numpy expectation (jit=False: eagerly, for jax's
    eager-only reference of its TPU op)."""
    rng = np.random.default_rng(sorted(WINDOWED).index(case))
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **WINDOWED[case])
    _, extra = windowed_args(WINDOWED[case])
    q, k, v, pool, layer, meta = args
    fn = functools.partial(attend, sm_scale=q.shape[-1] ** -0.5, softcap=extra["softcap"], **config)
    fn = jax.jit(fn, static_argnames=("window",)) if jit else fn
    out, _ = fn(q, k, v, pool, layer, meta, window=extra["window"])
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=tol * (5 if ON_GPU else 1), rtol=tol)
    return args, extra, expected, total


# every case on the default tiles; split-K and tiles smaller than the window on the two that need them most
@pytest.mark.parametrize(
    "case, config",
    [(c, {}) for c in sorted(WINDOWED)]
    + [("window-prefix-hit", dict(num_splits=2, block_k=8)), ("window-mixed", dict(block_q=2, block_k=4))],
)
def test_sliding_window_and_softcap(case, config):
    args, extra, expected, total = check_windowed(case, pallas_attention, **config)
    q, k, v, pool, layer, meta = args
    traced = jax.jit(
        lambda w: pallas_attention(
            q, k, v, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5, window=w, softcap=extra["softcap"], **config
        )[0]
    )
    np.testing.assert_allclose(np.asarray(traced(jnp.int32(extra["window"])))[:total], expected[:total], atol=1e-4)
