"""Long random operation sequences against a brute-force model of the cache.

The model keeps the set of cached page-prefixes ((namespace, tokens[:k*S]) -> page of the k-th page) and their
last-use times; it knows nothing about nodes, edges or splits. After every operation the cache must agree with
it, hold its invariants, and own every page exactly once together with the free list.
"""

import chex
import numpy as np
import pytest

from sgjax.cache import PageAllocator, RadixCache, TableCache
from sgjax.cache.base import MatchResult

NAMESPACES = (None, "image-a", 7)


class PrefixModel:
    def __init__(self, page_size):
        self.S = page_size
        self.pages: dict[tuple, int] = {}  # (ns, prefix tuple) -> page index of its last page
        self.ts: dict[tuple, int] = {}
        self.clock = 0

    def keys_of(self, ns, tokens):
        return [(ns, tuple(tokens[: j * self.S])) for j in range(1, len(tokens) // self.S + 1)]

    def match(self, ns, tokens, touch=True):
        hit = []
        for k in self.keys_of(ns, tokens):
            if k not in self.pages:
                break
            hit.append(k)
        if touch:
            self.clock += 1
            for k in hit:
                self.ts[k] = self.clock
        return len(hit) * self.S, [self.pages[k] for k in hit]

    def insert(self, ns, tokens, pages):
        """Returns (tokens already present, pages the cache must have freed)."""
        self.clock += 1
        present, freed = 0, []
        for k, p in zip(self.keys_of(ns, tokens), pages):
            if k in self.pages:
                present += self.S
                if self.pages[k] != p:
                    freed.append(p)
            else:
                self.pages[k] = int(p)
            self.ts[k] = self.clock
        return present, freed

    def protected(self, locked):
        out = set()
        for ns, prefix in locked:
            out.update(self.keys_of(ns, prefix))
        return out

    def leaves(self):
        has_child = {(ns, t[: -self.S]) for ns, t in self.pages}
        return [k for k in self.pages if k not in has_child]


def snapshot(cache: RadixCache):
    """The cache's content as the model's {(ns, prefix): page} map, read straight from the tree."""
    out = {}
    for ns, root in cache._roots.items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            if node is not root:
                toks = tuple(node.tokens.tolist())
                for j, page in enumerate(node.value):
                    out[(ns, prefix + toks[: (j + 1) * cache.page_size])] = int(page)
                prefix = prefix + toks
            stack.extend((c, prefix) for c in node.children.values())
    return out


def random_tokens(rng, pool, S):
    """Sequences that share prefixes often: extend a random prefix of an earlier sequence."""
    if pool and rng.random() < 0.8:
        base = pool[rng.integers(len(pool))]
        base = base[: rng.integers(0, len(base) + 1)]
    else:
        base = []
    seq = base + rng.integers(0, 3, size=rng.integers(0, 4 * S + 1)).tolist()
    seq = seq[: 12 * S]
    pool.append(seq)
    if len(pool) > 40:
        pool.pop(0)
    return seq


def check_ownership(cache, model):
    a = cache.allocator
    owned = sorted(model.pages.values())
    assert sorted(owned + a.free_pages().tolist()) == list(range(1, a.num_pages)), "page leaked or owned twice"


def run_radix(num_ops, page_size, num_pages, seed):
    rng = np.random.default_rng(seed)
    a = PageAllocator(num_pages)
    c = RadixCache(a, page_size)
    model = PrefixModel(page_size)
    locked = []  # (node, ns, prefix)
    pool: list[list[int]] = []
    seen = []  # (MatchResult, ns, tokens) of earlier matches: rematch resumes them after whatever ran since
    counts = dict.fromkeys(
        ["match", "insert", "insert_fresh", "lock", "unlock", "evict", "flush", "reset", "grow", "rematch"], 0
    )
    ops = list(counts)
    weights = np.array([25, 20, 10, 10, 10, 15, 2, 1, 8, 12], float)
    for _ in range(num_ops):
        op = ops[rng.choice(len(ops), p=weights / weights.sum())]
        ns = NAMESPACES[rng.integers(len(NAMESPACES))]
        toks = random_tokens(rng, pool, page_size)
        if op == "rematch" and not seen:
            counts[op] -= 1
        elif op in ("match", "lock", "rematch"):
            if op == "rematch":  # the waiting queue's pattern: the same tokens again, from the last match
                prev, ns, toks = seen.pop(int(rng.integers(len(seen))))
                m = c.rematch(prev, toks, ns)
            else:
                m = c.match_prefix(toks, ns)
            want_len, want_pages = model.match(ns, toks)
            assert m.num_tokens == want_len
            chex.assert_trees_all_equal(m.pages, np.asarray(want_pages, np.int32))
            seen = (seen + [(m, ns, toks)])[-40:]
            if op == "lock":
                c.lock(m.last_node)
                locked.append((m.last_node, ns, tuple(toks[: m.num_tokens])))
        elif op in ("insert", "insert_fresh"):
            full = len(toks) // page_size * page_size
            toks = toks[:full]
            if op == "insert":  # engine path: reuse the matched pages, compute only the rest
                m = c.match_prefix(toks, ns)
                model.match(ns, toks)
                reuse, need = m.pages, (full - m.num_tokens) // page_size
                c.lock(m.last_node)  # as the scheduler does: the eviction below must not take the matched pages
            else:  # recomputed everything: the duplicates must be freed by insert
                reuse, need = np.zeros(0, np.int32), full // page_size
            if a.num_free < need:
                c.evict(need - a.num_free)
                model.pages = {k: v for k, v in model.pages.items() if k in snapshot(c)}
            fresh = a.alloc(need)
            if fresh is None:
                counts[op] -= 1
            else:
                pages = np.concatenate([reuse, fresh]).astype(np.int32)
                want_present, want_freed = model.insert(ns, toks, pages.tolist())
                assert c.insert(toks, pages, ns) == want_present
                assert set(want_freed) <= set(a.free_pages().tolist())
            if op == "insert":
                c.unlock(m.last_node)
        elif op == "unlock":
            if locked:
                node, _, _ = locked.pop(rng.integers(len(locked)))
                c.unlock(node)
        elif op == "grow":
            # The scheduler's pattern: a request inserts its longer sequence with the pages it matched when it
            # was admitted (still locked), though other inserts and evictions ran since.
            if not locked:
                counts[op] -= 1
            else:
                i = int(rng.integers(len(locked)))
                node, ns, prefix = locked[i]
                grown = list(prefix) + [int(t) for t in toks[: len(toks) // page_size * page_size]]
                need = (len(grown) - len(prefix)) // page_size
                if a.num_free < need:
                    c.evict(need - a.num_free)
                    model.pages = {k: v for k, v in model.pages.items() if k in snapshot(c)}
                fresh = a.alloc(need)
                if fresh is None or need == 0:
                    counts[op] -= 1
                    if fresh is not None:
                        a.free(fresh)
                else:
                    matched = [model.pages[k] for k in model.keys_of(ns, list(prefix))]
                    pages = np.concatenate([np.asarray(matched, np.int32), fresh]).astype(np.int32)
                    want_present, want_freed = model.insert(ns, grown, pages.tolist())
                    # half the time from the locked node, as the scheduler inserts and re-matches a prefix it holds
                    held = MatchResult(np.asarray(matched, np.int32), node, len(prefix)) if rng.random() < 0.5 else None
                    assert c.insert(grown, pages, ns, below=held) == want_present
                    assert not set(want_freed) & set(matched), "a page the request matched was freed"
                    assert set(want_freed) <= set(a.free_pages().tolist())
                    m = c.rematch(held, grown, ns)
                    assert m.num_tokens == len(grown)
                    c.lock(m.last_node)
                    c.unlock(node)
                    locked[i] = (m.last_node, ns, tuple(grown))
        elif op in ("evict", "flush"):
            before = dict(model.pages)
            protected = model.protected((ns_, p) for _, ns_, p in locked)
            want = int(rng.integers(1, 8)) if op == "evict" else c.evictable_pages
            freed = c.evict(want) if op == "evict" else c.flush()
            after = snapshot(c)
            assert after.items() <= before.items()
            removed = before.keys() - after.keys()
            assert freed == len(removed)
            assert not removed & protected, "a locked page was evicted"
            model.pages = after
            # Only leaves go: what stays is still closed under taking prefixes.
            assert all(len(k[1]) == page_size or (k[0], k[1][:-page_size]) in after for k in after)
            assert freed >= want or len(after) == len(protected), "evict stopped while pages were evictable"
            survivors = [k for k in model.leaves() if k not in protected]
            if removed and survivors:
                # LRU: nothing evicted was used more recently than an evictable leaf that survived.
                assert max(model.ts[k] for k in removed) <= min(model.ts[k] for k in survivors)
        elif op == "reset":
            if c.protected_pages == 0:  # locks on roots (empty matches) protect nothing
                c.reset()
                model.pages.clear()
                assert a.num_free == a.capacity
            else:
                with pytest.raises(ValueError):
                    c.reset()
        counts[op] += 1
        c.check_invariants()
        assert snapshot(c) == model.pages
        check_ownership(c, model)
        assert c.protected_pages == len(model.protected((ns_, p) for _, ns_, p in locked))
    return counts


@pytest.mark.parametrize("page_size,num_pages,seed", [(1, 48, 0), (2, 40, 1), (4, 24, 2)])
def test_radix_cache_agrees_with_brute_force_model(page_size, num_pages, seed):
    counts = run_radix(10_000, page_size, num_pages, seed)
    assert sum(counts.values()) >= 8_000  # inserts and grows that find no pages do not count
    assert min(counts.values()) > 0, counts  # every kind of operation really ran


class TableModel:
    """Whole stored sequences; an entry extends the longest stored sequence it started with when inserted."""

    def __init__(self, page_size):
        self.S = page_size
        self.pages: dict[tuple, tuple] = {}  # (ns, seq) -> pages of the whole seq
        self.parent: dict[tuple, tuple | None] = {}

    def longest(self, ns, tokens):
        best = None
        for ns_, seq in self.pages:
            if ns_ == ns and len(seq) <= len(tokens) and tuple(tokens[: len(seq)]) == seq:
                if best is None or len(seq) > len(best[1]):
                    best = (ns_, seq)
        return best

    def chain(self, key):
        out = []
        while key is not None:
            out.append(key)
            key = self.parent[key]
        return out


def table_snapshot(cache: TableCache):
    out = {}
    for (ns, _), node in cache._table.items():
        vals, n = [], node
        while n.parent is not None:
            vals.append(n.value)
            n = n.parent
        out[(ns, tuple(node.tokens.tolist()))] = tuple(np.concatenate(vals[::-1]).tolist())
    return out


def table_insert(c: TableCache, model: "TableModel", ns, full: list, reused) -> tuple | None:
    """The engine's insert: `reused` pages (a match), fresh ones for the rest, evicting first if they are short.
    Checks the return value and records the entry in the model; None when no pages could be found."""
    need = len(full) // c.page_size - len(reused)
    if c.allocator.num_free < need:
        c.evict(need - c.allocator.num_free)
        model.pages = {k: v for k, v in model.pages.items() if k in table_snapshot(c)}
    best = model.longest(ns, full)
    fresh = c.allocator.alloc(need)
    if fresh is None:
        return None
    pages = np.concatenate([np.asarray(reused, np.int32), fresh]).astype(np.int32)
    assert c.insert(full, pages, ns) == (len(best[1]) if best else 0)
    key = (ns, tuple(full))
    if key not in model.pages:
        have = len(model.pages[best]) if best else 0
        model.pages[key] = (model.pages[best] if best else ()) + tuple(pages[have:].tolist())
        model.parent[key] = best
    return key


@pytest.mark.parametrize("page_size,num_pages,seed", [(1, 64, 3), (2, 48, 4)])
def test_table_cache_agrees_with_brute_force_model(page_size, num_pages, seed):
    rng = np.random.default_rng(seed)
    a = PageAllocator(num_pages)
    c = TableCache(a, page_size)
    model = TableModel(page_size)
    locked, pool, evicted, grown = [], [], 0, 0
    for _ in range(10_000):
        ns = NAMESPACES[rng.integers(len(NAMESPACES))]
        toks = random_tokens(rng, pool, page_size)
        full = toks[: len(toks) // page_size * page_size]
        op = rng.choice(["match", "insert", "lock", "unlock", "evict", "grow"], p=[0.25, 0.25, 0.1, 0.1, 0.2, 0.1])
        same_ns = [s_ for (n_, s_) in model.pages if n_ == ns and len(s_) > page_size]
        if op in ("insert", "lock") and same_ns and rng.random() < 0.3:
            # A strict prefix of a stored sequence: stored later, it is an entry of its own beside the longer one,
            # and a request that hits it can later grow into the longer one's tokens ("grow").
            s_ = same_ns[rng.integers(len(same_ns))]
            full = toks = list(s_[: page_size * int(rng.integers(1, len(s_) // page_size))])
        if op == "grow" and locked:
            # A running request that matched `key` earlier inserts its longer sequence as the scheduler does:
            # with the pages it matched then, though a longer entry stored since may hold the same tokens.
            i = int(rng.integers(len(locked)))
            node, key = locked[i]
            ns, seq = key
            longer = [s_ for (n_, s_) in model.pages if n_ == ns and len(s_) > len(seq) and s_[: len(seq)] == seq]
            tail = list(longer[rng.integers(len(longer))][len(seq) :]) if longer and rng.random() < 0.7 else []
            full = list(seq) + tail + [int(t) for t in rng.integers(1, 5, size=page_size * int(rng.integers(0, 2)))]
            full = full[: len(full) // page_size * page_size]
        best = model.longest(ns, full)
        if op == "grow" and locked and len(full) > len(seq):
            new_key = table_insert(c, model, ns, full, model.pages[key])
            if new_key is not None:
                m = c.match_prefix(full, ns)
                assert m.num_tokens == len(full)
                c.lock(m.last_node)
                c.unlock(node)
                locked[i] = (m.last_node, new_key)
                grown += 1
        if op in ("match", "lock"):
            m = c.match_prefix(toks, ns)
            assert m.num_tokens == (len(best[1]) if best else 0)
            chex.assert_trees_all_equal(m.pages, np.asarray(model.pages[best] if best else (), np.int32))
            if op == "lock" and best:
                c.lock(m.last_node)
                locked.append((m.last_node, best))
        elif op == "insert" and full:
            m = c.match_prefix(full, ns)
            if m.last_node is not None:
                c.lock(m.last_node)  # as the scheduler does: an eviction for the new pages must not take these
            table_insert(c, model, ns, full, m.pages)
            if m.last_node is not None:
                c.unlock(m.last_node)
        elif op == "unlock" and locked:
            c.unlock(locked.pop(rng.integers(len(locked)))[0])
        elif op == "evict":
            protected = {k for _, key in locked for k in model.chain(key)}
            before = set(model.pages)
            c.evict(int(rng.integers(1, 6)))
            model.pages = {k: v for k, v in model.pages.items() if k in table_snapshot(c)}
            removed = before - set(model.pages)
            evicted += len(removed)
            assert not removed & protected, "a locked entry was evicted"
            assert all(model.parent[k] is None or model.parent[k] in model.pages for k in model.pages)
        c.check_invariants()
        assert table_snapshot(c) == model.pages
        owned = [p for k, v in model.pages.items() for p in v[len(model.pages.get(model.parent[k], ())) :]]
        assert sorted(owned + a.free_pages().tolist()) == list(range(1, num_pages)), "page leaked or owned twice"
    assert evicted > 100  # the pool was small enough for eviction to matter
    assert grown > 30
