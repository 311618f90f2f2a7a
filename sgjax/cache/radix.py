"""RadixAttention's cache: a radix tree from token-id sequences to KV pages (paper section 3).

Edges hold whole pages: with page_size S an edge's key is a multiple of S tokens and its value one page index per
S tokens. A request's partial tail page is never shared (its KV is incomplete); the engine keeps it private.
Children are keyed by the bytes of their first page, so a lookup per edge is one dict probe plus one memcmp of
the whole edge; numpy is only used to find where a mismatching edge diverges.
"""

from __future__ import annotations

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
    check_insert_args,
)


def _common_prefix_bytes(a: bytes, b: bytes, n: int) -> int:
    """Number of leading int32 tokens (out of the first n) that a and b share."""
    x = np.frombuffer(a, dtype=np.int32, count=n)
    y = np.frombuffer(b, dtype=np.int32, count=n)
    neq = x != y
    return int(neq.argmax()) if neq.any() else n


class RadixCache(NodeStore):
    """Longest-prefix matching over pages, with edge splitting, namespaces, reference counts and LRU eviction.

    Ownership: every page given to `insert` belongs to the cache afterwards. New pages join the tree; pages for
    tokens that were already cached are freed at once (the cached copy wins), except those that *are* the cached
    pages (the caller got them from match_prefix). So after `insert` the caller owns nothing it passed in, and
    should re-match to point its page table at the cached pages if the request keeps running.
    """

    def __init__(self, allocator: PageAllocator, page_size: int = 1):
        super().__init__(allocator, page_size)

    def _slot(self, node: Node) -> bytes:
        return node.key[: self._page_bytes]

    def _split(self, child: Node, at: int) -> Node:
        """Cut `child`'s edge after `at` tokens; returns the new upper node. `child` object stays the lower
        part so that lock handles to it remain valid; the upper part inherits its references."""
        cut = at * TOKEN_BYTES
        upper = Node(child.key[:cut], child.value[: at // self.page_size], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        child.parent.children[self._slot(upper)] = upper
        child.key = child.key[cut:]
        child.value = child.value[at // self.page_size :]
        child.parent = upper
        upper.children[self._slot(child)] = child
        self._num_nodes += 1
        return upper

    def _walk(self, root: Node, qb: bytes, n: int, now: int, pages: list):
        """Follow `qb` (n tokens, page-aligned) down from `root`, splitting the last edge at the divergence.

        Touches every node on the matched path with `now` and appends their pages to `pages`.
        Returns (last matched node, matched tokens).
        """
        S, PB = self.page_size, self._page_bytes
        node, pos = root, 0
        while pos < n:
            child = node.children.get(qb[pos * TOKEN_BYTES : pos * TOKEN_BYTES + PB])
            if child is None:
                break
            klen = len(child.key) // TOKEN_BYTES
            m = min(klen, n - pos)
            seg = qb[pos * TOKEN_BYTES : (pos + m) * TOKEN_BYTES]
            if m == klen and seg == child.key:
                matched = klen
            else:
                matched = _common_prefix_bytes(seg, child.key, m) // S * S
                if matched < klen:
                    child = self._split(child, matched)
            child.last_access = now
            pages.append(child.value)
            node = child
            pos += matched
            if matched < klen:
                break
        return node, pos

    def match_prefix(self, tokens, extra_key: Hashable = None) -> MatchResult:
        """Longest cached prefix of `tokens` in namespace `extra_key`, in whole pages.

        Splits the edge where the match ends so that `last_node` covers exactly the matched pages; lock it while
        a request uses them.
        """
        t = as_tokens(tokens)
        root = self._roots.get(extra_key)
        n = len(t) // self.page_size * self.page_size
        if root is None or n == 0 or not root.children:
            return MatchResult(EMPTY_PAGES, self.root if root is None else root, 0)
        pages: list[np.ndarray] = []
        node, pos = self._walk(root, t.tobytes(), n, self._tick(), pages)
        self._push_if_evictable(node)  # its timestamp moved: the old heap entry is stale now
        if not pages:
            return MatchResult(EMPTY_PAGES, node, 0)
        return MatchResult(pages[0] if len(pages) == 1 else np.concatenate(pages), node, pos)

    def rematch(self, prev: MatchResult | None, tokens, extra_key: Hashable = None) -> MatchResult:
        """match_prefix(tokens, extra_key), resumed from `prev`, an earlier match of the same tokens.

        A waiting request is matched again every admission round; walking from the root each time made the
        matches most of the tree's time on a long queue. The path to `prev.last_node` still holds the same
        tokens and pages while that node is in the tree: inserts only add leaves or split edges (the lower part
        keeps the node object and its end), and eviction removes leaves first, so a live node's ancestors are
        live. A root is live while it is still its namespace's root (reset and empty namespaces replace it)."""
        t = as_tokens(tokens)
        n = len(t) // self.page_size * self.page_size
        if not self._resumable(prev, n, extra_key):
            return self.match_prefix(t, extra_key)
        node = prev.last_node
        now = self._tick()
        self._touch_path(node, now)
        pos = prev.num_tokens
        pages: list[np.ndarray] = []
        if pos < n and node.children:
            node, more = self._walk(node, t[pos:n].tobytes(), n - pos, now, pages)
            pos += more
        self._push_if_evictable(node)
        if not pages:
            return prev if node is prev.last_node else MatchResult(prev.pages, node, pos)
        return MatchResult(np.concatenate([prev.pages, *pages]), node, pos)

    def unchanged_since(self, prev: MatchResult, clock: int, extra_key: Hashable = None) -> bool:
        """Whether matching prev's tokens again would give prev: its last node is still in the tree and nothing was
        added below it since `clock` (the clock when prev was taken). The match ended there because no child
        continued it; evictions elsewhere and edge splits below keep that true (a split's upper part starts with
        the same page), and only a new leaf under that node can extend it. Cheap enough to ask every round."""
        return self._resumable(prev, prev.num_tokens, extra_key) and prev.last_node.grown <= clock

    def touch(self, prev: MatchResult) -> MatchResult:
        """What matching prev's tokens again does when `unchanged_since` holds, without reading them: the path's
        LRU times move to now, and prev is the answer."""
        node = prev.last_node
        self._touch_path(node, self._tick())
        self._push_if_evictable(node)
        return prev

    @staticmethod
    def _touch_path(node: Node, now: int) -> None:
        """What a walk from the root does to the path above a resumed node: a parent is never older than its
        children (LRU evicts leaves, so their ancestors must not look staler)."""
        while node.parent is not None:
            node.last_access = now
            node = node.parent

    def _resumable(self, prev: MatchResult | None, n: int, extra_key: Hashable) -> bool:
        node = prev.last_node if prev is not None else None
        return not (
            node is None
            or node.value is None
            or prev.num_tokens > n
            or (node.parent is None and self._roots.get(extra_key) is not node)
        )

    def insert(self, tokens, pages, extra_key: Hashable = None, below: MatchResult | None = None) -> int:
        """Cache `tokens` (whole pages) with their KV `pages`. Returns how many tokens were already cached.

        The cache takes ownership of all of `pages`; see the class docstring for what happens to duplicates.
        `below`: a match of a prefix of `tokens` whose pages are those of `pages` (a running request's locked
        prefix): the walk starts at its node (see rematch for why that path still holds).
        """
        t, p = check_insert_args(tokens, pages, self.page_size)
        n = len(t)
        if n == 0:
            return 0
        now = self._tick()
        if self._resumable(below, n, extra_key):
            node, start = below.last_node, below.num_tokens
            self._touch_path(node, now)
        else:
            node, start = self._root(extra_key), 0
        qb = t[start:].tobytes()
        cached: list[np.ndarray] = []
        node, pos = self._walk(node, qb, n - start, now, cached)
        first = start // self.page_size
        if pos:
            self._free_duplicates(p[first : first + pos // self.page_size], np.concatenate(cached))
        if pos < n - start:
            self._add_leaf(node, qb[pos * TOKEN_BYTES :], p[first + pos // self.page_size :], now)
        else:
            self._push_if_evictable(node)
        return start + pos

    def _check_node(self, node: Node) -> None:
        ntok = len(node.key) // TOKEN_BYTES
        if len(node.key) % TOKEN_BYTES or ntok % self.page_size or ntok == 0:
            raise CacheInvariantError(f"edge of {ntok} tokens is not whole pages of {self.page_size}")
        if len(node.value) != ntok // self.page_size:
            raise CacheInvariantError("edge length and page count disagree")
