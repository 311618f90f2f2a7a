"""The paper's ablations behind the PrefixCache interface (Figure 8c): no cache, and a table without a tree.

`NoCache` reuses nothing: every inserted page is freed at once. `TableCache` remembers whole sequences under a
hash of all their tokens: a request hits only when an entire earlier sequence is a prefix of it (multi-turn chat
still hits; few-shot siblings that share the examples but not the question do not), because without a tree
there is nothing to split at the point where two requests diverge. Lookup probes one hash per distinct stored
length. An entry extends at most the longest stored entry it starts with and owns only the pages past it, so
pages are never shared between owners and locks, eviction and accounting come from NodeStore unchanged.
"""

from __future__ import annotations

import bisect
from typing import Hashable

import numpy as np

from sgjax.cache.allocator import EMPTY_PAGES, PageAllocator
from sgjax.cache.base import (
    TOKEN_BYTES,
    CacheInvariantError,
    MatchResult,
    Node,
    NodeStore,
    as_tokens,
    check_accounting,
    check_insert_args,
)


class NoCache:
    """`--disable-radix-cache`: nothing is kept, so nothing is ever matched."""

    def __init__(self, allocator: PageAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = int(page_size)

    def match_prefix(self, tokens, extra_key: Hashable = None) -> MatchResult:
        return MatchResult(EMPTY_PAGES, None, 0)

    def rematch(self, prev: MatchResult | None, tokens, extra_key: Hashable = None) -> MatchResult:
        return MatchResult(EMPTY_PAGES, None, 0)

    clock = 0

    def unchanged_since(self, prev: MatchResult, clock: int, extra_key: Hashable = None) -> bool:
        return False  # matching again costs nothing here

    def insert(self, tokens, pages, extra_key: Hashable = None, below: MatchResult | None = None) -> int:
        _, p = check_insert_args(tokens, pages, self.page_size)
        self.allocator.free(p)
        return 0

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def flush(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    evictable_pages = 0
    protected_pages = 0

    def check_invariants(self, in_flight: int = 0) -> None:
        check_accounting(self, in_flight)


class TableCache(NodeStore):
    """Whole-sequence hash table with LRU eviction (the "no tree structure" ablation)."""

    def __init__(self, allocator: PageAllocator, page_size: int = 1):
        super().__init__(allocator, page_size)

    def _new_tree(self) -> None:
        super()._new_tree()
        self._table: dict[tuple[Hashable, bytes], Node] = {}
        self._length_count: dict[int, int] = {}
        self._lengths: list[int] = []  # distinct stored lengths in tokens, ascending

    def _slot(self, node: Node) -> bytes:
        return node.key

    def _longest(self, qb: bytes, n: int, extra_key: Hashable) -> Node | None:
        hi = bisect.bisect_right(self._lengths, n)
        for L in reversed(self._lengths[:hi]):
            entry = self._table.get((extra_key, qb[: L * TOKEN_BYTES]))
            if entry is not None:
                return entry
        return None

    @staticmethod
    def _chain(entry: Node, now: int) -> list[np.ndarray]:
        """Pages of `entry` and the entries it extends, root first; marks them all used at `now`."""
        vals = []
        while entry.parent is not None:
            entry.last_access = now
            vals.append(entry.value)
            entry = entry.parent
        vals.reverse()
        return vals

    def match_prefix(self, tokens, extra_key: Hashable = None) -> MatchResult:
        t = as_tokens(tokens)
        n = len(t) // self.page_size * self.page_size
        entry = self._longest(t.tobytes(), n, extra_key) if self._lengths else None
        if entry is None:
            return MatchResult(EMPTY_PAGES, None, 0)
        vals = self._chain(entry, self._tick())
        self._push_if_evictable(entry)
        return MatchResult(np.concatenate(vals), entry, len(entry.key) // TOKEN_BYTES)

    def insert(self, tokens, pages, extra_key: Hashable = None, below: MatchResult | None = None) -> int:
        t, p = check_insert_args(tokens, pages, self.page_size)
        n = len(t)
        if n == 0:
            return 0
        qb = t.tobytes()
        now = self._tick()
        entry = self._longest(qb, n, extra_key)
        have = 0
        if entry is not None:
            have = len(entry.key) // TOKEN_BYTES
            self._free_duplicates(p[: have // self.page_size], np.concatenate(self._chain(entry, now)))
        if have == n:
            self._push_if_evictable(entry)
            return n
        leaf = self._add_leaf(entry or self._root(extra_key), qb, p[have // self.page_size :], now)
        leaf.namespace = extra_key
        self._table[(extra_key, qb)] = leaf
        c = self._length_count.get(n, 0)
        self._length_count[n] = c + 1
        if c == 0:
            bisect.insort(self._lengths, n)
        return have

    def _delete_leaf(self, node: Node) -> int:
        del self._table[(node.namespace, node.key)]
        n = len(node.key) // TOKEN_BYTES
        self._length_count[n] -= 1
        if self._length_count[n] == 0:
            del self._length_count[n]
            self._lengths.pop(bisect.bisect_left(self._lengths, n))
        return super()._delete_leaf(node)

    def check_invariants(self, in_flight: int = 0) -> None:
        super().check_invariants(in_flight)
        if len(self._table) != self._num_nodes or sum(self._length_count.values()) != self._num_nodes:
            raise CacheInvariantError("hash table or length index out of step with the entries")

    def _check_node(self, node: Node) -> None:
        ntok = len(node.key) // TOKEN_BYTES
        parent_ntok = len(node.parent.key) // TOKEN_BYTES
        if ntok % self.page_size or len(node.value) * self.page_size != ntok - parent_ntok:
            raise CacheInvariantError("entry pages do not cover exactly the tokens past its parent")
        if node.key[: len(node.parent.key)] != node.parent.key:
            raise CacheInvariantError("an entry does not extend its parent")
        if self._table.get((node.namespace, node.key)) is not node:
            raise CacheInvariantError("entry missing from the hash table")
