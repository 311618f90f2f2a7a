"""The router's meta-tree: matching per worker, edge splits, per-worker LRU under the size bound, removal; random
operation sequences against a brute-force model (every key each worker was given)."""

import random

from sgjax.router.meta_tree import MetaTree


def test_match_reports_each_workers_longest_prefix():
    t = MetaTree()
    t.insert("text", "hello world", "a")
    t.insert("text", "hello there", "b")
    t.insert("text", "goodbye", "b")
    assert t.match("text", "hello world!") == {"a": 11, "b": 6}
    assert t.match("text", "hello wor") == {"a": 9, "b": 6}  # a match may end inside an edge
    assert t.match("text", "good") == {"b": 4}
    assert t.match("text", "xyz") == {}
    assert t.match("text", "hello world", workers={"b"}) == {"b": 6}
    t.check()


def test_text_and_ids_are_separate_sub_trees():
    t = MetaTree()
    t.insert("ids", (1, 2, 3, 4), "a")
    t.insert("text", "abc", "b")
    assert t.match("ids", (1, 2, 3, 9)) == {"a": 3}
    assert t.match("ids", (97, 98)) == {}
    assert t.match("text", "abcd") == {"b": 3}
    t.check()


def test_split_keeps_sizes_and_workers():
    t = MetaTree()
    t.insert("ids", tuple(range(10)), "a")
    t.insert("ids", tuple(range(5)) + (99, 98), "b")  # splits a's edge after 5 ids
    t.check()
    assert t.tokens("a") == 10 and t.tokens("b") == 7
    assert t.match("ids", tuple(range(10))) == {"a": 10, "b": 5}
    assert t.num_nodes() == 3


def test_lru_eviction_under_the_size_bound():
    t = MetaTree()
    t.capacity["a"] = 12
    x, y, z = (1,) * 5, (2,) * 5, (3,) * 5
    t.insert("ids", x, "a")
    t.insert("ids", y, "a")
    t.insert("ids", x, "a")  # touches x: y is now the least recently used
    t.insert("ids", z, "a")  # 15 > 12: y goes
    assert t.match("ids", y) == {}
    assert t.match("ids", x) == {"a": 5} and t.match("ids", z) == {"a": 5}
    assert t.tokens("a") == 10
    t.check()


def test_eviction_drops_leaves_and_keeps_a_shared_prefix():
    t = MetaTree()
    t.capacity["a"] = 14
    prefix = tuple(range(100, 110))
    t.insert("ids", prefix + (1, 1), "a")
    t.insert("ids", prefix + (2, 2), "a")  # 14 tokens: fits
    t.insert("ids", prefix + (3, 3), "a")  # 16: the oldest leaf (1, 1) goes, the shared prefix stays
    assert t.match("ids", prefix + (1, 1)) == {"a": 10}
    assert t.match("ids", prefix + (3, 3)) == {"a": 12}
    assert t.tokens("a") == 14
    t.check()


def test_eviction_is_per_worker():
    t = MetaTree()
    t.capacity["a"] = 6
    t.insert("ids", (1, 2, 3, 4, 5), "a")
    t.insert("ids", (1, 2, 3, 4, 5), "b")  # b has no bound
    t.insert("ids", (7, 8, 9), "a")  # a over its bound: its (1..5) goes, b's stays
    assert t.match("ids", (1, 2, 3, 4, 5)) == {"b": 5}
    assert t.match("ids", (7, 8, 9)) == {"a": 3}
    t.check()


def test_text_is_bounded_in_estimated_tokens():
    t = MetaTree()  # 4 characters per token until observed
    t.capacity["a"] = 5
    t.insert("text", "a" * 20, "a")
    assert t.tokens("a") == 5
    t.insert("text", "b" * 4, "a")  # 6 tokens: the older leaf goes
    assert t.match("text", "a" * 20) == {} and t.tokens("a") == 1
    t.observe(chars=30, tokens=10)
    assert t.chars_per_token == 3.0
    assert abs(t.tokens("a") - 4 / 3) < 1e-9


def test_remove_worker_and_clear():
    t = MetaTree()
    t.insert("text", "shared prefix then a", "a")
    t.insert("text", "shared prefix then b", "b")
    t.insert("text", "only a", "a")
    t.remove_worker("a")
    t.check()
    assert t.match("text", "shared prefix then a") == {"b": 19}
    assert t.match("text", "only a") == {}
    assert t.workers() == ["b"]
    t.clear()
    assert t.match("text", "shared prefix then b") == {} and t.num_nodes() == 0
    t.check()


def _brute_match(held: dict, key) -> dict:
    out = {}
    for w, keys in held.items():
        best = 0
        for k in keys:
            n = 0
            while n < min(len(k), len(key)) and k[n] == key[n]:
                n += 1
            best = max(best, n)
        if best:
            out[w] = best
    return out


def test_random_operations_against_a_brute_force_model():
    rng = random.Random(0)
    alphabet = "abc"
    workers = ["w0", "w1", "w2"]
    for bounded in (False, True):
        t = MetaTree()
        if bounded:
            for w in workers:
                t.capacity[w] = 6  # 24 characters each
        held = {w: set() for w in workers}  # everything each worker was given since its last removal
        for step in range(3000):
            op = rng.random()
            key = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10)))
            w = rng.choice(workers)
            if op < 0.6:
                t.insert("text", key, w)
                held[w].add(key)
            elif op < 0.62:
                t.remove_worker(w)
                held[w].clear()
            else:
                got, want = t.match("text", key), _brute_match(held, key)
                if bounded:  # sound (never claims more than was given), within the bound
                    assert all(m <= want.get(u, 0) for u, m in got.items()), (step, got, want)
                else:
                    assert got == want, (step, key, got, want)
            if bounded:
                assert all(t.tokens(u) <= 6 for u in workers)
            if step % 50 == 0:
                t.check()
        t.check()


def test_the_most_recent_prompt_survives_eviction():
    rng = random.Random(1)
    t = MetaTree()
    t.capacity["w"] = 20  # 80 characters
    for _ in range(500):
        key = "".join(rng.choice("xyz") for _ in range(rng.randint(5, 40)))
        t.insert("text", key, "w")
        assert t.match("text", key) == {"w": len(key)}  # what was just dispatched is never the one dropped
        assert t.tokens("w") <= 20
    t.check()
