"""Scheduler unit tests with a fake model that reads its context back through the page tables.

The fake "KV pool" stores the token written at each slot; the next token is a hash of the context read through the
request's page table. So a request's output is right only if every page it reads (cached prefix pages from the
tree, its own pages, pages recomputed after a retraction) holds exactly the tokens it should.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from sgjax.cache import POLICIES
from sgjax.engine.request import Req
from sgjax.engine.scheduler import Scheduler, SchedulerConfig

V = 1000


def next_token(context) -> int:
    c = np.asarray(context, np.int64)
    return int((c * np.arange(1, len(c) + 1)).sum() % V)


def reference(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


class FakeRunner:
    def __init__(self, num_pages, page_size):
        self.slots = np.full(num_pages * page_size, -1, np.int64)
        self.page_size = page_size

    def run(self, works):
        tokens, lps, tops = [], [], []
        for w in works:
            pages = np.asarray(w.req.pages)
            pos = np.arange(w.start, w.start + len(w.tokens))
            self.slots[pages[pos // self.page_size] * self.page_size + pos % self.page_size] = w.tokens
            end = w.start + len(w.tokens)
            allpos = np.arange(end)
            ctx = self.slots[pages[allpos // self.page_size] * self.page_size + allpos % self.page_size]
            assert (ctx >= 0).all(), "read a slot that was never written"
            tokens.append(next_token(ctx) if w.sample else -1)
            lps.append(0.0)
            tops.append(None)
            w.target_results = [(0.0, None)] * len(w.target_rows)
        return tokens, lps, tops


def make_req(i, prompt, max_new):
    return Req(rid=str(i), input_ids=list(prompt), params=SimpleNamespace(max_new_tokens=max_new), seed=0)


def drive(sched, runner, reqs, rng=None, abort_prob=0.0, check_every=1):
    """The engine loop without the engine: returns {rid: output_ids} of requests that finished normally."""
    for r in reqs:
        sched.add(r)
    done, step = {}, 0
    while sched.has_work:
        if rng is not None and abort_prob and rng.random() < abort_prob:
            live = sched.waiting + sched.running
            sched.abort(live[rng.integers(len(live))].rid)
        works = sched.schedule()
        if not works:
            continue
        tokens, lps, tops = runner.run(works)
        for req in sched.commit(works, tokens, lps, tops):
            if len(req.output_ids) >= req.params.max_new_tokens:
                sched.finish(req)
                done[req.rid] = list(req.output_ids)
        step += 1
        if step % check_every == 0:
            sched.check_invariants()
    sched.check_invariants()
    return done


def shared_prefix_workload(rng, n, vocab=V):
    prefixes = [rng.integers(0, vocab, rng.integers(10, 80)).tolist() for _ in range(4)]
    reqs = []
    for i in range(n):
        p = prefixes[rng.integers(4)] + rng.integers(0, vocab, rng.integers(1, 40)).tolist()
        reqs.append(make_req(i, p, int(rng.integers(1, 24))))
    return reqs


def assert_no_leak(sched):
    a, c = sched.allocator, sched.cache
    assert a.num_free + c.evictable_pages == a.capacity and c.protected_pages == 0
    c.flush()
    assert a.num_free == a.capacity


@pytest.mark.parametrize("cache", ["radix", "table", "none"])
@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_exact_under_every_policy_and_cache(policy, cache):
    rng = np.random.default_rng(0)
    reqs = shared_prefix_workload(rng, 40)
    sched = Scheduler(
        SchedulerConfig(
            num_pages=200, page_size=4, policy=policy, cache=cache, chunked_prefill_size=64, max_running_requests=8
        )
    )
    done = drive(sched, FakeRunner(200, 4), reqs)
    assert set(done) == {r.rid for r in reqs}
    for r in reqs:
        assert done[r.rid] == reference(r.input_ids, r.params.max_new_tokens)
    if cache == "radix":
        assert sched.stats.cached_tokens > 0
    if cache == "none":
        assert sched.stats.cached_tokens == 0
    assert_no_leak(sched)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_small_pool_retracts_and_still_finishes_everything_correctly(page_size):
    rng = np.random.default_rng(1)
    reqs = [make_req(i, rng.integers(0, V, rng.integers(5, 40)).tolist(), int(rng.integers(20, 60))) for i in range(30)]
    num_pages = 1 + -(-160 // page_size)  # room for ~2 requests at their full length
    sched = Scheduler(
        SchedulerConfig(
            num_pages=num_pages,
            page_size=page_size,
            chunked_prefill_size=32,
            max_running_requests=16,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.0,
        )
    )
    done = drive(sched, FakeRunner(num_pages, page_size), reqs)
    assert sched.stats.retractions > 0
    assert any(r.retractions for r in reqs)
    for r in reqs:
        assert done[r.rid] == reference(r.input_ids, r.params.max_new_tokens)
    assert_no_leak(sched)


def test_retraction_during_decode_resumes_with_the_same_tokens():
    rng = np.random.default_rng(6)
    reqs = [make_req(i, rng.integers(0, V, 4).tolist(), 40) for i in range(8)]
    sched = Scheduler(SchedulerConfig(num_pages=51, page_size=4, init_new_token_ratio=0.0, min_new_token_ratio=0.0))
    retracted_with_output = []
    orig = sched._retract_one

    def spy():
        victim = min(sched.running, key=lambda r: (len(r.output_ids), -len(r.input_ids), -r.arrival))
        retracted_with_output.append(len(victim.output_ids))
        orig()

    sched._retract_one = spy
    done = drive(sched, FakeRunner(51, 4), reqs)
    assert retracted_with_output and min(retracted_with_output) > 0
    for r in reqs:
        assert done[r.rid] == reference(r.input_ids, 40)
    assert_no_leak(sched)


def test_chunked_prefill_of_a_long_prompt():
    rng = np.random.default_rng(2)
    long = make_req(0, rng.integers(0, V, 300).tolist(), 5)
    short = [make_req(i, rng.integers(0, V, 10).tolist(), 30) for i in range(1, 4)]
    sched = Scheduler(SchedulerConfig(num_pages=200, page_size=4, chunked_prefill_size=64))
    chunks = []
    orig = sched.schedule

    def spy():
        works = orig()
        chunks.extend(len(w.tokens) for w in works if w.req is long)
        return works

    sched.schedule = spy
    done = drive(sched, FakeRunner(200, 4), [long] + short)
    assert max(chunks) <= 64 and sum(chunks) >= 300
    for r in [long] + short:
        assert done[r.rid] == reference(r.input_ids, r.params.max_new_tokens)
    assert_no_leak(sched)


def test_decode_rows_count_against_the_prefill_chunk():
    """A step that mixes prefill chunks with decode rows stays within chunked_prefill_size tokens (its token
    bucket), and prefills still move (at least a quarter of the chunk) while many requests decode."""
    rng = np.random.default_rng(5)
    decoding = [make_req(i, rng.integers(0, V, 6).tolist(), 40) for i in range(6)]
    long = [make_req(10 + i, rng.integers(0, V, 200).tolist(), 3) for i in range(2)]
    sched = Scheduler(SchedulerConfig(num_pages=300, page_size=4, chunked_prefill_size=64, max_running_requests=8))
    steps = []
    orig = sched.schedule

    def spy():
        works = orig()
        if works:
            steps.append((sum(len(w.tokens) for w in works), sum(1 for w in works if w.req in long)))
        return works

    sched.schedule = spy
    done = drive(sched, FakeRunner(300, 4), decoding + long)
    mixed = [total for total, prefills in steps if prefills]
    assert mixed and max(mixed) <= 64  # 6 decode rows + 58 prefill tokens, not 6 + 64
    for r in decoding + long:
        assert done[r.rid] == reference(r.input_ids, r.params.max_new_tokens)
    few = Scheduler(SchedulerConfig(num_pages=10, page_size=4, chunked_prefill_size=64))
    assert few._prefill_budget(60) == 16  # the floor
    assert_no_leak(sched)


def test_500_random_requests_with_random_aborts_leak_nothing():
    rng = np.random.default_rng(3)
    reqs = shared_prefix_workload(rng, 500)
    sched = Scheduler(SchedulerConfig(num_pages=120, page_size=4, chunked_prefill_size=48, max_running_requests=12))
    done = drive(sched, FakeRunner(120, 4), reqs, rng=rng, abort_prob=0.3, check_every=7)
    aborted = {r.rid for r in reqs} - set(done)
    assert 10 < len(aborted) < 400
    for r in reqs:
        if r.rid in done:
            assert done[r.rid] == reference(r.input_ids, r.params.max_new_tokens)
    assert_no_leak(sched)


def test_admission_waits_for_a_prefix_being_computed_in_the_same_round():
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, V, 64).tolist()
    reqs = [make_req(i, prefix + [i], 2) for i in range(4)]
    sched = Scheduler(SchedulerConfig(num_pages=100, page_size=4))
    done = drive(sched, FakeRunner(100, 4), reqs)
    assert len(done) == 4
    # The first computes the prefix; the others wait one round and hit its 64 cached tokens.
    assert sorted(r.cached_tokens for r in reqs) == [0, 64, 64, 64]


def test_admission_waits_for_a_prefix_still_being_prefilled_in_chunks():
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, V, 100).tolist()
    reqs = [make_req(i, prefix + [i, i + 1], 2) for i in range(2)]
    sched = Scheduler(SchedulerConfig(num_pages=200, page_size=4, chunked_prefill_size=64))
    done = drive(sched, FakeRunner(200, 4), reqs)
    assert len(done) == 2
    # The first prefills 102 tokens in chunks of 64 and 38; the budget left next to its second chunk must not admit
    # the other on the first chunk alone (64 cached): it waits one more step and hits all 100 shared tokens.
    assert [r.cached_tokens for r in reqs] == [0, 100]


def test_prefill_only_and_cached_prefix_lengths():
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, V, 40).tolist()
    sched = Scheduler(SchedulerConfig(num_pages=100, page_size=4))
    runner = FakeRunner(100, 4)
    first = make_req(0, prefix, 0)
    drive(sched, runner, [first])
    assert first.output_ids == [] and first.cached_tokens == 0
    branches = [make_req(i, prefix + rng.integers(0, V, 5).tolist(), 3) for i in (1, 2)]
    drive(sched, runner, branches)
    assert [b.cached_tokens for b in branches] == [40, 40]
    # A full hit still recomputes the last token (it needs the logits), in whole pages: 40 tokens -> 36 reused.
    again = make_req(3, prefix, 1)
    drive(sched, runner, [again])
    assert again.cached_tokens == 36
    assert_no_leak(sched)


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulerConfig(num_pages=10, policy="sjf")


def test_tree_seconds_count_cache_operations_and_admit_seconds_the_whole_admission(monkeypatch):
    # tree_seconds is the paper's RadixAttention overhead: only the cache's own operations. A slow cache shows
    # in it; a slow policy order shows only in admit_seconds.
    import time

    import sgjax.engine.scheduler as scheduler_module

    rng = np.random.default_rng(5)
    sched = Scheduler(SchedulerConfig(num_pages=256, page_size=4, max_running_requests=4))
    calls = {"match": 0, "order": 0}
    match, order = sched.cache.match_prefix, scheduler_module.schedule_order

    def slow_match(*args):
        calls["match"] += 1
        time.sleep(0.002)
        return match(*args)

    def slow_order(*args):
        calls["order"] += 1
        time.sleep(0.05)
        return order(*args)

    monkeypatch.setattr(sched.cache, "match_prefix", slow_match)
    monkeypatch.setattr(scheduler_module, "schedule_order", slow_order)
    drive(sched, FakeRunner(256, 4), shared_prefix_workload(rng, 8))
    s = sched.stats
    assert calls["match"] >= 8 and calls["order"] >= 1
    assert s.tree_seconds >= 0.002 * calls["match"]  # admission matches and the ones that cache a prefix
    assert s.admit_seconds >= 0.05 * calls["order"]
    assert s.tree_seconds < 0.0025 * calls["match"] + 0.025 * calls["order"]  # the policy's sleep is not in it


def tree_state(cache):
    """Everything a match or an eviction can read: each node's tokens, pages, LRU time and lock count."""
    return sorted(
        (n.key, n.value.tobytes(), n.last_access, n.lock_ref, n.grown) for n in cache._nodes() if n.value is not None
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_admission_reuses_matches_exactly_as_matching_every_round(seed):
    """A waiting request's match is reused until the tree grows under it: model-based against re-matching every
    round. Two schedulers take the same requests (shared prefixes, a pool small enough to evict and retract, a
    queue longer than the running slots, random aborts and late arrivals) step by step; each step's work, each
    request's hit and the whole tree (pages, LRU times, locks) must be the same."""
    rng = np.random.default_rng(seed)
    reqs = shared_prefix_workload(rng, 60)
    arrivals = rng.integers(0, 40, len(reqs))  # the step each request arrives at
    aborts = {int(s): int(i) for s, i in zip(rng.integers(0, 120, 6), rng.integers(0, 60, 6))}
    twins = []
    for match_cache in (False, True):
        cfg = SchedulerConfig(
            num_pages=60,
            page_size=4,
            chunked_prefill_size=48,
            max_running_requests=6,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.0,
            match_cache=match_cache,
        )
        twins.append(
            (
                Scheduler(cfg),
                FakeRunner(60, 4),
                {r.rid: make_req(r.rid, r.input_ids, r.params.max_new_tokens) for r in reqs},
            )
        )
    cache = twins[1][0].cache
    touches = []
    touch = cache.touch
    cache.touch = lambda prev: touches.append(1) or touch(prev)
    for step in range(2000):
        seen = []
        for sched, runner, mine in twins:
            for r in reqs:
                if arrivals[int(r.rid)] == step:
                    sched.add(mine[r.rid])
            if step in aborts:
                sched.abort(str(aborts[step]))
            works = sched.schedule()
            tokens, lps, tops = runner.run(works) if works else ([], [], [])
            for req in sched.commit(works, tokens, lps, tops):
                if len(req.output_ids) >= req.params.max_new_tokens:
                    sched.finish(req)
            sched.check_invariants()
            seen.append(
                (
                    [(w.req.rid, w.start, list(w.tokens)) for w in works],
                    [(r.rid, r.cached_tokens) for r in mine.values()],
                    tree_state(sched.cache),
                    sched.stats.retractions,
                )
            )
        assert seen[0] == seen[1], f"step {step}"
        if step > 40 and not any(s.has_work for s, _, _ in twins):
            break
    assert twins[0][0].stats.retractions > 0 and twins[0][0].stats.cached_tokens > 0
    assert len(touches) > 50  # the reused path ran
    for _, _, mine in twins:
        done = [r for r in mine.values() if r.rid not in {str(i) for i in aborts.values()}]
        for r in done:
            assert r.output_ids == reference(r.input_ids, r.params.max_new_tokens)
