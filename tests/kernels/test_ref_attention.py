"""The ref backend against a per-request numpy attention on random ragged batches.

These cases are the contract every attention backend (Pallas GPU/TPU) is tested against.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.kernels import AttentionMetadata, ref_attention
from sgjax.kernels.kv_pool import pool_shape


def make_case(
    rng,
    q_lens,
    prefix_lens,
    page_size,
    num_heads,
    num_kv_heads,
    head_dim=16,
    num_tokens=None,
    num_reqs=None,
    pages_per_req=None,
    window=0,
    softcap=None,
):
    """Random pool with cached prefixes, new q/k/v, metadata, and the expected output and pool. window > 0: a row
    at position p sees keys (p - window, p]; softcap: scores become softcap * tanh(scores / softcap)."""
    num_reqs = num_reqs or len(q_lens)
    kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    pages_per_req = pages_per_req or max(-(-k // page_size) for k in kv_lens)
    num_pages = 1 + num_reqs * pages_per_req
    pool = np.zeros(pool_shape(2, num_pages, page_size, num_kv_heads, head_dim), np.float32)
    pool[:, 1:] = rng.standard_normal(pool[:, 1:].shape)  # stale data must be masked, never read
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((num_reqs, pages_per_req), np.int32)
    total = sum(q_lens)
    num_tokens = num_tokens or total
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_reqs + 1, np.int32)
    expected = np.zeros_like(q)
    layer, scale, group = 1, head_dim**-0.5, num_heads // num_kv_heads
    t = 0
    for r, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        pages = perm[r * pages_per_req : (r + 1) * pages_per_req]
        table[r] = pages
        pos = np.arange(kl)
        seq_slots = pages[pos // page_size] * page_size + pos % page_size
        slots[t : t + ql] = seq_slots[kl - ql :]
        flat = pool[layer].reshape(-1, 2 * num_kv_heads, head_dim)
        keys, vals = flat[seq_slots, 0::2].copy(), flat[seq_slots, 1::2].copy()
        keys[kl - ql :], vals[kl - ql :] = k[t : t + ql], v[t : t + ql]
        for i in range(ql):
            p = kl - ql + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(num_heads):
                s = keys[lo : p + 1, h // group] @ q[t + i, h] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                expected[t + i, h] = (w / w.sum()) @ vals[lo : p + 1, h // group]
        t += ql
        cu[r + 1] = t
    cu[len(q_lens) + 1 :] = t
    lens = np.zeros(num_reqs, np.int32)
    lens[: len(kv_lens)] = kv_lens
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(lens),
        page_table=jnp.asarray(table),
    )
    return (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pool), layer, meta), expected, total


CASES = {
    "all-decode": dict(q_lens=[1, 1, 1, 1], prefix_lens=[0, 5, 17, 30], page_size=4),
    "all-prefill": dict(q_lens=[9, 3, 16], prefix_lens=[0, 0, 0], page_size=8),
    "mixed": dict(q_lens=[1, 12, 1, 5], prefix_lens=[20, 0, 7, 3], page_size=4),
    "prefix-hit-long": dict(q_lens=[4, 2], prefix_lens=[61, 96], page_size=16),
    "padded": dict(q_lens=[3, 1], prefix_lens=[2, 9], page_size=4, num_tokens=16, num_reqs=4, pages_per_req=6),
    # four blocks of 16 rows for "blocked": one request's rows, several requests then padding, padding only (x2)
    "blocks": dict(q_lens=[20, 1, 1, 3], prefix_lens=[5, 30, 0, 11], page_size=4, num_tokens=64, num_reqs=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("strategy", ["gather", "segment", "blocked", "paged"])
def test_ref_matches_per_request_attention(case, heads, strategy):
    rng = np.random.default_rng(sorted(CASES).index(case))
    args, expected, total = make_case(rng, num_heads=heads[0], num_kv_heads=heads[1], **CASES[case])
    q, k, v, pool, layer, meta = args
    attend = jax.jit(functools.partial(ref_attention, strategy=strategy), static_argnames=("sm_scale",))
    out, new_pool = attend(q, k, v, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5)
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=2e-5, rtol=1e-5)
    assert np.isfinite(np.asarray(out)).all()  # padded rows give zeros, not NaN
    # The new K/V landed at their slots, in the interleaved layout; other layers are untouched.
    flat = np.asarray(new_pool)[layer].reshape(-1, 2 * heads[1], q.shape[-1])
    slots = np.asarray(meta.slot_mapping)[:total]
    np.testing.assert_array_equal(flat[slots, 0::2], np.asarray(k)[:total])
    np.testing.assert_array_equal(flat[slots, 1::2], np.asarray(v)[:total])
    np.testing.assert_array_equal(np.asarray(new_pool)[0], np.asarray(pool)[0])


@pytest.mark.parametrize("case", ["mixed", "padded"])
@pytest.mark.parametrize("strategy", ["gather", "segment"])
def test_ref_in_row_blocks(case, strategy, monkeypatch):
    """Long batches are split into blocks of query rows (lax.map); the split must not change results."""
    monkeypatch.setattr("sgjax.kernels.ref._BLOCK_ELEMENTS", 1)  # blocks of one row
    args, expected, total = make_case(np.random.default_rng(7), num_heads=8, num_kv_heads=2, **CASES[case])
    q, k, v, pool, layer, meta = args
    attend = jax.jit(functools.partial(ref_attention, strategy=strategy), static_argnames=("sm_scale",))
    out, _ = attend(q, k, v, pool, layer, meta, sm_scale=q.shape[-1] ** -0.5)
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=2e-5, rtol=1e-5)


# Sliding windows shorter and longer than the cached prefixes, a window of one key, and Gemma 2's soft cap.
WINDOWED = {
    "window-mixed": dict(CASES["mixed"], window=6),
    "window-prefix-hit": dict(CASES["prefix-hit-long"], window=20),
    "window-one-key": dict(CASES["all-decode"], window=1),
    "window-softcap": dict(CASES["mixed"], window=9, softcap=1.5),
    "softcap-only": dict(CASES["all-prefill"], softcap=0.8),
    "window-blocks": dict(CASES["blocks"], window=7),
}


def windowed_args(spec):
    """(case spec without the mask options, the backend's window / softcap kwargs)."""
    spec = dict(spec)
    extra = {"window": spec.pop("window", 0), "softcap": spec.pop("softcap", None)}
    return spec, extra


@pytest.mark.parametrize("case", sorted(WINDOWED))
@pytest.mark.parametrize("strategy", ["gather", "segment", "blocked", "paged"])
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
def test_ref_sliding_window_and_softcap(case, strategy, traced):
    rng = np.random.default_rng(sorted(WINDOWED).index(case))
    args, expected, total = make_case(rng, num_heads=8, num_kv_heads=2, **WINDOWED[case])
    _, extra = windowed_args(WINDOWED[case])
    q, k, v, pool, layer, meta = args

    def attend(q, k, v, pool, meta, window):  # traced: the window a scanned layer loop gives (one per layer)
        return ref_attention(
            q,
            k,
            v,
            pool,
            layer,
            meta,
            sm_scale=q.shape[-1] ** -0.5,
            strategy=strategy,
            window=window,
            softcap=extra["softcap"],
        )

    if traced:
        out, _ = jax.jit(attend)(q, k, v, pool, meta, jnp.int32(extra["window"]))
    else:
        out, _ = jax.jit(functools.partial(attend, window=extra["window"]))(q, k, v, pool, meta)
    np.testing.assert_allclose(np.asarray(out)[:total], expected[:total], atol=2e-5, rtol=2e-5)


def test_cpu_strategy_follows_rows_per_request(monkeypatch):
    """On a CPU: one row per request (decode) reads its pages in place ("paged"); otherwise the blocked path, whose
    work does not grow with padded rows and requests (a row count that is not a multiple of a block keeps the cost
    rule)."""
    from sgjax.kernels import ref

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert ref.choose_strategy(16, 9, 3, 64, num_rows=16) == "paged"
    assert ref.choose_strategy(4, 9, 3, 64, num_rows=16) == "blocked"
    assert ref.choose_strategy(4, 9, 3, 64, num_rows=512) == "blocked"
    assert ref.choose_strategy(4, 9, 3, 64, num_rows=19) == "segment"
    assert ref.choose_strategy(1, 9, 3, 64, num_rows=256) == "blocked"  # one request: blocks skip the causal half
    assert ref.choose_strategy(1, 9, 3, 64, num_rows=1) == "segment"
    assert ref.choose_strategy(16, 9, 3, 64, num_rows=64) == "blocked"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert ref.choose_strategy(4, 9, 3, 64, num_rows=512) == "segment"
