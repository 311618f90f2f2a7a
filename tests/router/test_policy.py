"""Dispatch policies over snapshots of the workers, and the request keys they see."""

import json

import pytest

from sgjax.router.keys import prompt_key
from sgjax.router.policy import (
    CacheAware,
    Random,
    RoundRobin,
    ShortestQueue,
    WorkerView,
    imbalanced,
    least_loaded,
    make_policy,
)

A, B, C = "http://a", "http://b", "http://c"


def views(*loads, dispatched=None):
    urls = [A, B, C][: len(loads)]
    return [WorkerView(u, n, (dispatched or [0] * len(loads))[i]) for i, (u, n) in enumerate(zip(urls, loads))]


def text(s):
    return ("text", s)


def test_round_robin_cycles_over_the_given_workers():
    p = RoundRobin()
    assert [p.select(views(0, 0, 0), None).url for _ in range(6)] == [A, B, C, A, B, C]
    assert p.select(views(5, 0), None).url in (A, B)  # load does not matter


def test_shortest_queue_takes_the_fewest_in_flight_then_the_fewest_dispatched():
    p = ShortestQueue()
    assert p.select(views(3, 1, 2), None).url == B
    assert p.select(views(1, 1, 1, dispatched=[4, 2, 3]), None).url == B
    assert p.select(views(0, 0, 0), None).url == A  # full tie: the first


def test_random_is_seeded_and_stays_within_the_candidates():
    picks = [Random(seed=7).select(views(0, 0, 0), None).url for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same first pick
    p = Random(seed=1)
    seen = [p.select(views(0, 0, 0), None).url for _ in range(200)]
    assert set(seen) == {A, B, C} and all(40 < seen.count(u) < 100 for u in (A, B, C))
    assert all(p.select(views(0, 0), None).url in (A, B) for _ in range(50))


def test_imbalance_needs_both_thresholds():
    assert not imbalanced([10, 0], abs_threshold=32, rel_threshold=1.0001)
    assert imbalanced([40, 0], abs_threshold=32, rel_threshold=1.0001)
    assert not imbalanced([140, 100], abs_threshold=32, rel_threshold=1.5)  # far apart, but within 1.5x
    assert imbalanced([160, 100], abs_threshold=32, rel_threshold=1.5)
    assert least_loaded(views(2, 1, 1), tiebreak=lambda w: {A: 0, B: 5, C: 3}[w.url]).url == C


def dispatch(p, workers, key):
    choice = p.select(workers, key)
    p.on_dispatch(choice.url, key)
    return choice


def test_cache_aware_follows_the_longest_prefix():
    p = CacheAware(cache_threshold=0.5, balance_abs_threshold=4)
    prefix = "Few-shot examples: " + "x" * 200
    first = dispatch(p, views(0, 0), text(prefix + "question 1"))
    assert (first.url, first.reason) == (A, "load")
    other = dispatch(p, views(1, 0), text("something else entirely"))
    assert (other.url, other.reason) == (B, "load")
    # The shared prefix is on A: A wins although it is busier, as long as load stays balanced.
    again = dispatch(p, views(3, 0), text(prefix + "question 2"))
    assert (again.url, again.reason, again.matched) == (A, "cache", len(prefix) + len("question "))
    assert p.decisions == {"cache": 1, "balance": 0, "load": 2}


def test_cache_aware_below_the_threshold_takes_the_least_loaded():
    p = CacheAware(cache_threshold=0.5)
    dispatch(p, views(0, 0), text("abcdefgh"))  # -> A
    c = p.select(views(1, 0), text("abcd" + "z" * 20))  # 4 / 24 matched on A
    assert (c.url, c.reason) == (B, "load")
    c = p.select(views(1, 0), text("abcdefgh" + "z" * 4))  # 8 / 12 on A
    assert (c.url, c.reason) == (A, "cache")


def test_cache_aware_falls_back_to_the_least_loaded_when_imbalanced():
    p = CacheAware(cache_threshold=0.1, balance_abs_threshold=2, balance_rel_threshold=1.5)
    key = text("p" * 100)
    dispatch(p, views(0, 0), key)  # -> A
    assert p.select(views(2, 0), key).url == A  # difference 2: not above the threshold
    c = p.select(views(3, 0), key)  # 3 - 0 > 2 and 3 > 1.5 * 0
    assert (c.url, c.reason, c.matched) == (B, "balance", 0)


def test_cache_aware_ties_and_least_loaded_prefers_the_smaller_tree():
    p = CacheAware()
    dispatch(p, views(0, 0), text("long prompt on A " * 20))  # -> A, whose tree is now larger
    assert p.select(views(0, 0, dispatched=[0, 0]), text("unrelated")).url == B  # smaller tree wins the tie
    p2 = CacheAware()
    k = text("same prefix everywhere " * 10)
    p2.on_dispatch(A, k)
    p2.on_dispatch(B, k)
    assert p2.select(views(2, 1), k).url == B  # equal matches: the less loaded one


def test_cache_aware_only_chooses_candidates_and_forgets_workers():
    p = CacheAware()
    key = text("cached on A only, long enough to count")
    p.on_dispatch(A, key)
    assert p.select([WorkerView(B), WorkerView(C)], key).url in (B, C)  # A is down: not a candidate
    p.forget(A)
    assert p.tree.match("text", key[1]) == {}
    p.on_dispatch(B, key)
    p.clear()
    assert p.tree.match("text", key[1]) == {}


def test_cache_aware_capacity_and_stats():
    p = CacheAware()
    p.set_capacity(A, 10)
    p.observe(chars=40, tokens=10)
    for i in range(5):
        p.on_dispatch(A, text(f"{i}" * 30))  # 7.5 tokens each: only the newest fits in 10
    s = p.stats()
    assert s["meta_tree"]["chars_per_token"] == 4.0 and s["meta_tree"]["tokens"] == {A: 7.5}
    assert p.tree.match("text", "4" * 30) == {A: 30} and p.tree.match("text", "0" * 30) == {}


def test_make_policy():
    assert [make_policy(n).name for n in ("cache_aware", "round_robin", "shortest_queue", "random")] == [
        "cache_aware",
        "round_robin",
        "shortest_queue",
        "random",
    ]
    with pytest.raises(ValueError, match="unknown router policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAware(cache_threshold=2)


@pytest.mark.parametrize(
    "path,body,key",
    [
        ("/generate", {"text": "hi there"}, ("text", "hi there")),
        ("/generate", {"text": ["first", "second"]}, ("text", "first")),
        ("/generate", {"input_ids": [1, 2, 3]}, ("ids", (1, 2, 3))),
        ("/generate", {"input_ids": [[4, 5], [6]]}, ("ids", (4, 5))),
        ("/generate", {"input_ids": [1, "x"]}, None),
        ("/generate", {"text": ""}, None),
        ("/v1/completions", {"prompt": "once"}, ("text", "once")),
        ("/v1/completions", {"prompt": [[7, 8]]}, ("ids", (7, 8))),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, ("text", "<user>hi\x1e")),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
            ("text", "<user>ab\x1e"),
        ),
        ("/v1/chat/completions", {"messages": "nope"}, None),
    ],
)
def test_prompt_keys(path, body, key):
    assert prompt_key(path, json.dumps(body).encode()) == key


def test_prompt_keys_of_unreadable_bodies_and_chat_turns():
    assert prompt_key("/generate", b"{not json") is None
    assert prompt_key("/generate", b"[1, 2]") is None
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    k1 = prompt_key("/v1/chat/completions", json.dumps({"messages": turn1}).encode())[1]
    k2 = prompt_key("/v1/chat/completions", json.dumps({"messages": turn2}).encode())[1]
    assert k2.startswith(k1)  # the next turn extends the previous key
