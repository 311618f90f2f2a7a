"""The on-device sampler against a plain numpy reference (CPU, small vocabularies, few jit shapes)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.engine.sampler import (
    ROW_FIELDS,
    Branches,
    SamplingBatch,
    default_rows,
    noise_bits,
    pack_sampling,
    process_logits,
    sample,
    sampling_size,
    unpack_sampling,
)

L, V, W, K = 8, 128, 6, 4  # the main jit shape


# ---------------------------------------------------------------------------------------------
# numpy reference


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def softmax(x):
    return np.exp(log_softmax(x))


def ref_process(logits, rows, mask=None, filters=True):
    """Penalties -> logit_bias -> mask -> temperature -> top-k -> top-p -> min-p, one row at a time."""
    out = np.array(logits, np.float32)
    vocab = out.shape[-1]
    for r, x in enumerate(out):
        window = rows["history"][r]
        hist = window[(window >= 0) & (window < 2 * vocab)]
        seen = np.unique(hist % vocab)
        p = rows["repetition_penalty"][r]
        x[seen] = np.where(x[seen] > 0, x[seen] / p, x[seen] * p)
        count = np.bincount(hist[hist < vocab], minlength=vocab).astype(np.float32)
        x -= rows["frequency_penalty"][r] * count + rows["presence_penalty"][r] * (count > 0)
        biased = window >= 2 * vocab
        np.add.at(x, window[biased] - 2 * vocab, rows["bias"][r][biased])
        if mask is not None and mask[r].any():
            x[~mask[r]] = -np.inf
        if rows["temperature"][r] > 0:
            x /= rows["temperature"][r]
        if not filters:
            continue
        keep = np.isfinite(x)
        k = rows["top_k"][r]
        if k > 0:
            keep &= x >= np.sort(x)[::-1][min(k, vocab) - 1]
        if rows["top_p"][r] < 1:
            probs = softmax(np.where(keep, x, -np.inf))
            order = np.argsort(-probs, kind="stable")
            before = np.cumsum(probs[order]) - probs[order]
            in_p = np.zeros(vocab, bool)
            in_p[order[before < rows["top_p"][r]]] = True
            in_p[order[0]] = True
            keep &= in_p
        if rows["min_p"][r] > 0:
            probs = softmax(np.where(keep, x, -np.inf))
            keep &= probs >= rows["min_p"][r] * probs.max()
        x[~keep] = -np.inf
    return out


def random_rows(rng, num_rows=L, width=W, vocab=V):
    rows = default_rows(num_rows, width)
    rows["temperature"][:] = rng.choice([0.0, 0.5, 0.9, 1.0, 1.7], num_rows)
    rows["top_k"][:] = rng.choice([0, 0, 1, 5, 40, 1000], num_rows)
    rows["top_p"][:] = np.where(rng.random(num_rows) < 0.5, 1.0, rng.uniform(0.2, 0.95, num_rows))
    rows["min_p"][:] = np.where(rng.random(num_rows) < 0.5, 0.0, rng.uniform(0.01, 0.3, num_rows))
    rows["frequency_penalty"][:] = rng.uniform(-0.5, 1.5, num_rows)
    rows["presence_penalty"][:] = rng.uniform(-0.5, 1.5, num_rows)
    rows["repetition_penalty"][:] = rng.uniform(0.8, 2.0, num_rows)
    rows["seed"][:] = rng.integers(-(2**31), 2**31, num_rows)
    rows["step"][:] = rng.integers(0, 1000, num_rows)
    # few distinct ids so that counts > 1; prompt entries are id + V; -1 padding anywhere
    ids = rng.integers(0, 12, (num_rows, width)) * 7 % vocab
    rows["history"][:] = np.where(rng.random((num_rows, width)) < 0.3, ids + vocab, ids)
    rows["history"][rng.random((num_rows, width)) < 0.2] = -1
    # logit_bias entries (id + 2V, the bias beside it), a repeated id among them adding up
    biased = rng.random((num_rows, width)) < 0.15
    rows["history"][biased] = rng.integers(0, 20, biased.sum()) * 5 % vocab + 2 * vocab
    rows["bias"][biased] = rng.uniform(-100, 100, biased.sum())
    return rows


def device_batch(rows, needs_filter=None) -> SamplingBatch:
    fields = {name: jnp.asarray(rows[name], dtype) for name, dtype, _ in ROW_FIELDS}
    nf = int(rows["needs_filter"]) if needs_filter is None else needs_filter
    return SamplingBatch(
        **fields, history=jnp.asarray(rows["history"]), needs_filter=jnp.int32(nf), bias=jnp.asarray(rows["bias"])
    )


def random_logits(rng, num_rows=L, vocab=V, scale=3.0):
    return (rng.standard_normal((num_rows, vocab)) * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# jitted entry points (the engine's way: one packed buffer)

TRACES = {"packed": 0}


@functools.partial(jax.jit, static_argnames=("num_rows", "width", "k", "branches"))
def packed_sample(buffer, logits, num_rows=L, width=W, k=K, branches=Branches()):
    TRACES["packed"] += 1
    return sample(logits, unpack_sampling(buffer, num_rows, width), num_top_logprobs=k, branches=branches)


@jax.jit
def masked_sample(buffer, logits, mask):
    return sample(logits, unpack_sampling(buffer, L, W), num_top_logprobs=K, mask=mask)


process = jax.jit(process_logits)


def run(rows, logits, **kw):
    out = packed_sample(pack_sampling(rows), logits, num_rows=len(logits), width=rows["history"].shape[1], **kw)
    return jax.tree.map(np.asarray, out)


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("filters", [True, False])
def test_process_logits_matches_numpy(filters):
    rng = np.random.default_rng(0 if filters else 1)
    for _ in range(6):
        rows, logits = random_rows(rng), random_logits(rng)
        got = np.asarray(process(jnp.asarray(logits), device_batch(rows, needs_filter=int(filters))))
        want = ref_process(logits, rows, filters=filters)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
        if filters:  # the filters did remove something, and always keep each row's top token
            assert (~fin).any()
            assert fin[np.arange(L), np.argmax(want, -1)].all()


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    rng = np.random.default_rng(2)
    for _ in range(4):
        rows, logits = random_rows(rng), random_logits(rng)
        rows["temperature"][::2] = 0.0  # greedy by temperature
        rows["top_k"][1::4] = 1  # greedy by top_k == 1
        greedy = (rows["temperature"] == 0) | (rows["top_k"] == 1)
        out = run(rows, logits)
        want = np.argmax(ref_process(logits, rows), -1)
        np.testing.assert_array_equal(out.tokens[greedy], want[greedy])


def test_argmax_is_jnp_argmax():
    """sampler.argmax (a max, then the first index reaching it) picks what jnp.argmax does: ties go to the first
    index, a row of -inf (everything masked) to 0, as does a row of NaN here (jnp.argmax gives the first NaN)."""
    from sgjax.engine.sampler import argmax

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1000)).astype(np.float32)
    x[1, [17, 400, 999]] = 50.0  # a tie: the first wins
    x[2] = -np.inf
    x[3, 999] = np.inf
    x[4] = np.round(x[4])  # many ties at the maximum
    x[5] = np.nan
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got[:5], np.argmax(x[:5], axis=-1))
    assert got[5] == 0 and got.dtype == np.int32


def test_default_rows_are_greedy_without_penalties():
    rng = np.random.default_rng(3)
    logits = random_logits(rng)
    rows = default_rows(L, W)
    rows["history"][:, :3] = np.argsort(-logits, -1)[:, :3]  # present, but every penalty is off
    out = run(rows, logits)
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(4)
    rows = random_rows(rng)
    rows["temperature"][:3] = [-0.0, 1e-38, np.float32(np.pi)]
    buffer = pack_sampling(rows)
    assert buffer.dtype == np.int32 and buffer.shape == (sampling_size(L, W),)
    batch = jax.jit(unpack_sampling, static_argnums=(1, 2))(buffer, L, W)
    for name, dtype, _ in ROW_FIELDS:
        got = np.asarray(getattr(batch, name))
        assert got.dtype == dtype, name
        np.testing.assert_array_equal(got.view(np.int32), rows[name].view(np.int32), err_msg=name)  # bit-exact
    np.testing.assert_array_equal(np.asarray(batch.history), rows["history"])
    np.testing.assert_array_equal(np.asarray(batch.bias).view(np.int32), rows["bias"].view(np.int32))
    assert int(batch.needs_filter) == 1  # rows use top-k/top-p/min-p: set even though rows said 0
    assert int(unpack_sampling(pack_sampling(default_rows(L, W)), L, W).needs_filter) == 0
    empty = unpack_sampling(pack_sampling(default_rows(3, 0)), 3, 0)
    assert empty.history.shape == (3, 0) and sampling_size(3, 0) == 34  # 11 fields x 3 rows + the filter flag


def test_logprobs_and_top_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(5)
    rows, logits = random_rows(rng), random_logits(rng)
    rows["target"][::3] = rng.integers(0, V, len(rows["target"][::3]))  # prompt rows
    out = run(rows, logits)
    lsm = log_softmax(logits)
    chosen = np.where(rows["target"] >= 0, rows["target"], out.tokens)
    np.testing.assert_allclose(out.logprobs, lsm[np.arange(L), chosen], rtol=1e-5, atol=1e-5)
    want_ids = np.argsort(-logits, -1)[:, :K]
    np.testing.assert_array_equal(out.top_ids, want_ids)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lsm, want_ids, -1), rtol=1e-5, atol=1e-5)
    assert out.top_ids.dtype == np.int32 and out.tokens.dtype == np.int32
    none = run(rows, logits, k=0)
    assert none.top_ids.shape == (L, 0) and none.top_logprobs.shape == (L, 0)
    np.testing.assert_array_equal(none.tokens, out.tokens)
    np.testing.assert_array_equal(none.logprobs, out.logprobs)


def test_static_branches_choose_what_the_device_would():
    """An accelerator's step fixes the sampler's optional parts in its shape (no device predicate): drawing always
    and filtering exactly when the host saw a filter gives the tokens the lax.conds give; turning the filters off
    statically for rows that use none changes nothing, and for rows that use them it does (the flag is live)."""
    rng = np.random.default_rng(11)
    for case in range(3):
        rows, logits = random_rows(rng), random_logits(rng)
        rows["temperature"][::3] = 0.0
        if case == 1:  # every row greedy: the static draw must still leave them greedy
            rows["temperature"][:] = 0.0
        filters = bool(np.asarray(unpack_sampling(pack_sampling(rows), L, W).needs_filter))
        device = run(rows, logits)
        static = run(rows, logits, branches=Branches.for_step(True, filters))
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(static, name), getattr(device, name), err_msg=f"{case} {name}")
    rows, logits = random_rows(rng), random_logits(rng, scale=0.5)
    rows["temperature"][:] = 1.0
    rows["top_k"][:] = 2
    unfiltered = run(rows, logits, branches=Branches(draws=True, filters=False)).tokens
    filtered = run(rows, logits, branches=Branches(draws=True, filters=True)).tokens
    top2 = np.argsort(-ref_process(logits, rows, filters=False), -1)[:, :2]
    assert all(t in top2[r] for r, t in enumerate(filtered))
    assert not all(t in top2[r] for r, t in enumerate(unfiltered))


def test_sampling_frequencies_match_the_distribution():
    n, vocab = 4096, 64
    rng = np.random.default_rng(6)
    base = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    logits = np.broadcast_to(base, (n, vocab))
    rows = default_rows(n, 0)
    rows["temperature"][:] = 1.0
    rows["seed"][:] = np.arange(n) * 7919 - 10**6  # many requests, negative seeds too
    rows["step"][:] = rng.integers(0, 50, n)
    cases = [({}, softmax(base)), ({"top_k": 8, "top_p": 0.8}, None), ({"temperature": 0.7, "min_p": 0.05}, None)]
    for params, want in cases:
        case = {k: v.copy() for k, v in rows.items()}
        for name, value in params.items():
            case[name][:] = value
        if want is None:
            want = softmax(ref_process(logits[:1], case)[0])
        tokens = run(case, logits, k=0).tokens
        freq = np.bincount(tokens, minlength=vocab) / n
        assert freq[want == 0].sum() == 0, params  # filtered tokens never appear
        tol = 4 * np.sqrt(want * (1 - want) / n) + 2e-3
        assert np.all(np.abs(freq - want) <= tol), (params, np.max(np.abs(freq - want) - tol))


def test_same_seed_same_token_whatever_the_batch():
    rng = np.random.default_rng(7)
    logits = random_logits(rng, scale=1.0)  # flat enough that the noise decides
    rows = random_rows(rng)
    rows["temperature"][:] = 0.9
    rows["top_k"][:] = 0
    rows["top_p"][:] = 1.0
    rows["min_p"][:] = 0.0
    alone = run(rows, logits).tokens
    # the same 8 requests at other positions of a 16-row batch, with neighbours that use filters
    # (so the sort runs), penalties and prompt rows
    big_rows, big_logits = random_rows(rng, num_rows=16), random_logits(rng, num_rows=16)
    big_rows["target"][::5] = 3
    pos = rng.permutation(16)[:L]
    for name in rows:
        if name != "needs_filter":
            big_rows[name][pos] = rows[name]
    big_logits[pos] = logits
    crowd = run(big_rows, big_logits)
    assert int(unpack_sampling(pack_sampling(big_rows), 16, W).needs_filter) == 1
    np.testing.assert_array_equal(crowd.tokens[pos], alone)
    # reversed order within the 8-row batch
    np.testing.assert_array_equal(
        run({k: v[::-1] if v.ndim else v for k, v in rows.items()}, logits[::-1]).tokens, alone[::-1]
    )
    # other seeds, or other steps, give other tokens
    flat = np.zeros((L, V), np.float32)
    rows["history"][:] = -1
    rows["seed"][:] = 1234
    rows["step"][:] = np.arange(L)
    by_step = run(rows, flat).tokens
    rows["step"][:] = 0
    rows["seed"][:] = np.arange(L)
    by_seed = run(rows, flat).tokens
    assert len(set(by_step)) > L // 2 and len(set(by_seed)) > L // 2
    rows["seed"][:] = 1234
    assert len(set(run(rows, flat).tokens)) == 1  # same (seed, step): same token in every row


def test_noise_bits_are_uniform_and_independent_across_seeds_steps_and_ids():
    """The hash behind the Gumbel noise (sampler.noise_bits): every bit a fair coin, each row's 24-bit uniforms flat,
    and no correlation between neighbouring seeds, steps or token ids, no two rows alike. Caught when tried: ids
    hashed linearly (id * constant + key), a key of seed + step."""
    seeds = np.concatenate([np.arange(32) * 7919 - 10**6, np.full(32, 5)]).astype(np.int32)
    steps = np.concatenate([np.full(32, 3), np.arange(32)]).astype(np.int32)
    bits = np.asarray(jax.jit(noise_bits, static_argnums=2)(jnp.asarray(seeds), jnp.asarray(steps), 32768))
    n = bits.size
    ones = np.unpackbits(bits.view(np.uint8)).reshape(n, 32).mean(axis=0)  # per bit position
    assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(n)), ones
    u = (bits >> 8) / 2.0**24
    counts, _ = np.histogram(u, 256, (0.0, 1.0))
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), chi2
    bound = 6 / np.sqrt(u.shape[1])
    corr = np.corrcoef(u) - np.eye(len(u))  # rows: neighbouring seeds (first 32), neighbouring steps (last 32)
    assert np.abs(corr).max() < bound
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 6 / np.sqrt(n)  # neighbouring ids
    assert len({r.tobytes() for r in bits}) == len(bits)


def test_mask_is_respected():
    rng = np.random.default_rng(8)
    for i in range(8):
        rows, logits = random_rows(rng), random_logits(rng)
        mask = rng.random((L, V)) < 0.2
        mask[0] = False  # an error row: raw argmax, no NaN
        mask[1] = False
        mask[1, np.argsort(logits[1])[:2]] = True  # only the two least likely tokens
        rows["target"][:] = -1
        out = jax.tree.map(np.asarray, masked_sample(pack_sampling(rows), logits, mask))
        assert out.tokens[0] == np.argmax(logits[0])
        assert mask[np.arange(1, L), out.tokens[1:]].all()
        assert np.isfinite(out.logprobs).all() and np.isfinite(out.top_logprobs).all()
        greedy = (rows["temperature"] == 0) | (rows["top_k"] == 1)
        want = np.argmax(ref_process(logits, rows, mask), -1)
        np.testing.assert_array_equal(out.tokens[greedy], want[greedy])


def test_one_compile_for_every_parameter_mix():
    rng = np.random.default_rng(9)
    logits = random_logits(rng)
    run(default_rows(L, W), logits)  # make sure this shape is compiled
    before = TRACES["packed"]
    for i in range(10):
        rows = random_rows(rng) if i % 2 else default_rows(L, W)
        rows["target"][: i % 3] = 5
        rows["needs_filter"] = np.array(i % 2, np.int32)
        run(rows, logits)
    assert TRACES["packed"] == before
