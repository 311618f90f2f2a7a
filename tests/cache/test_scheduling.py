"""Theorem 3.1 and Algorithm 1: the optimum, and which schedules reach it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgjax.cache import (
    PageAllocator,
    RadixCache,
    SimConfig,
    optimal_computed_tokens,
    optimal_hit_rate,
    schedule_order,
    simulate,
)

SETTINGS = settings(derandomize=True, deadline=None, max_examples=60, database=None)


@st.composite
def request_trees(draw, max_requests=24):
    """Requests that branch off earlier ones at random points: the shapes of few-shot, chat and tree search."""
    n = draw(st.integers(1, max_requests))
    reqs: list[list[int]] = []
    for _ in range(n):
        base: list[int] = []
        if reqs and draw(st.booleans()):
            parent = reqs[draw(st.integers(0, len(reqs) - 1))]
            base = parent[: draw(st.integers(0, len(parent)))]
        suffix = draw(st.lists(st.integers(0, 3), min_size=0 if base else 1, max_size=10))
        reqs.append(base + suffix)
    return reqs


def brute_force_optimum(reqs, page_size=1, extra_keys=None):
    """Distinct whole-page prefixes (each computed once) plus every request's partial tail page."""
    keys = extra_keys or [None] * len(reqs)
    S = page_size
    prefixes = {(k, tuple(r[: j * S])) for r, k in zip(reqs, keys) for j in range(1, len(r) // S + 1)}
    return len(prefixes) * S + sum(len(r) % S for r in reqs)


@SETTINGS
@given(request_trees(), st.sampled_from([1, 2, 3]))
def test_optimum_counts_each_distinct_prefix_once(reqs, page_size):
    assert optimal_computed_tokens(reqs, page_size) == brute_force_optimum(reqs, page_size)


def test_optimum_respects_namespaces():
    reqs = [[1, 2, 3], [1, 2, 3], [1, 2, 4]]
    assert optimal_computed_tokens(reqs) == 4
    assert optimal_computed_tokens(reqs, extra_keys=["a", "b", "a"]) == 7
    assert optimal_hit_rate(reqs) == pytest.approx(1 - 4 / 9)
    assert optimal_hit_rate([]) == 0.0


def _capacity(reqs, page_size):
    return max(-(-len(r) // page_size) * page_size for r in reqs)


@settings(SETTINGS, max_examples=150)
@given(request_trees(), st.sampled_from([1, 2]), st.sampled_from(["lpm", "dfs-weight"]))
def test_cache_aware_order_reaches_the_theorem_3_1_optimum(reqs, page_size, policy):
    """With a cache as large as the longest request, LPM (= DFS order) computes every edge exactly once."""
    res = simulate(reqs, SimConfig(capacity_tokens=_capacity(reqs, page_size), policy=policy, page_size=page_size))
    assert res.computed_tokens == optimal_computed_tokens(reqs, page_size)
    assert sorted(res.order) == list(range(len(reqs)))


@SETTINGS
@given(request_trees(), st.sampled_from(["fcfs", "random"]), st.integers(1, 3))
def test_no_order_or_cache_beats_the_optimum(reqs, policy, batch):
    best = optimal_computed_tokens(reqs)
    cap = 2 * _capacity(reqs, 1) * batch
    for cache in ("radix", "table"):
        res = simulate(reqs, SimConfig(capacity_tokens=cap, policy=policy, cache=cache, max_batch_requests=batch))
        assert best <= res.computed_tokens <= sum(map(len, reqs))
    assert simulate(reqs, SimConfig(capacity_tokens=cap, cache="none")).computed_tokens == sum(map(len, reqs))


def interleaved_groups(num_groups=4, per_group=6, shared=40, own=4, seed=0):
    """Groups of requests with a long shared prefix each (few-shot examples), arriving interleaved."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 1000, shared).tolist() for _ in range(num_groups)]
    return [heads[g] + rng.integers(0, 1000, own).tolist() for _ in range(per_group) for g in range(num_groups)]


def test_fcfs_and_random_thrash_where_lpm_does_not(capsys):
    """Figure 8c's scheduling ablation in miniature: the cache holds about one group's prefix at a time."""
    reqs = interleaved_groups()
    opt = optimal_computed_tokens(reqs)
    cap = 2 * max(map(len, reqs))
    rows = {}
    for policy in ("lpm", "dfs-weight", "fcfs", "random"):
        res = simulate(reqs, SimConfig(capacity_tokens=cap, policy=policy, seed=1))
        rows[policy] = res
    rows["table"] = simulate(reqs, SimConfig(capacity_tokens=cap, policy="lpm", cache="table"))
    with capsys.disabled():
        print(
            f"\noptimal hit rate {optimal_hit_rate(reqs):.3f}; achieved: "
            + ", ".join(f"{k} {r.hit_rate:.3f}" for k, r in rows.items())
        )
    assert rows["lpm"].computed_tokens == rows["dfs-weight"].computed_tokens == opt
    assert rows["fcfs"].computed_tokens > 3 * opt  # every request recomputes its group's prefix
    assert rows["random"].computed_tokens > opt
    assert rows["table"].computed_tokens > 3 * opt  # no tree: siblings never share the examples


def test_policies_order_as_documented():
    assert schedule_order("lpm", [0, 5, 5, 2]) == [1, 2, 3, 0]  # ties keep arrival order
    assert schedule_order("fcfs", [9, 0, 3]) == [0, 1, 2]
    assert sorted(schedule_order("random", [0] * 5, rng=np.random.default_rng(0))) == list(range(5))
    with pytest.raises(ValueError):
        schedule_order("lof", [1])
    with pytest.raises(ValueError):
        schedule_order("dfs-weight", [1, 2])


def test_dfs_weight_visits_the_heavier_subtree_first():
    a = PageAllocator(64)
    c = RadixCache(a)
    for seq in ([1, 1, 1], [2, 2, 2], [2, 2, 3]):
        c.insert(seq, _pages(c, seq))
    queries = [[1, 1, 1, 9], [2, 2, 2, 9], [2, 2, 3, 9], [5], [2, 2, 9]]
    nodes = [c.match_prefix(q).last_node for q in queries]
    # [2,2] holds three waiting requests, [1,1,1] one, the root (no match) one; deeper matches first.
    assert schedule_order("dfs-weight", [0] * 5, nodes) == [1, 2, 4, 0, 3]


def _pages(cache, seq):
    m = cache.match_prefix(seq)
    return np.concatenate([m.pages, cache.allocator.alloc(len(seq) - m.num_tokens)])


def test_simulator_refuses_a_request_larger_than_the_pool():
    with pytest.raises(RuntimeError, match="does not fit"):
        simulate([[1] * 10], SimConfig(capacity_tokens=5))
    with pytest.raises(ValueError):
        SimConfig(capacity_tokens=5, policy="lof")
