"""What every prefix cache shares: the result type, the protocol the scheduler programs against, the node store.

`NodeStore` holds the bookkeeping that does not depend on how prefixes are looked up: one root per namespace
(`extra_key`), reference counts along the path to the root, LRU eviction of unlocked leaves through a lazy heap,
the free/evictable/protected accounting and its invariant check. `RadixCache` (edge-splitting radix tree) and
`TableCache` (whole-prompt hash table, the paper's "no tree" ablation) differ only in lookup and insertion.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, runtime_checkable

import numpy as np

from sgjax.cache.allocator import EMPTY_PAGES, PageAllocator

TOKEN_BYTES = 4  # keys are int32 token ids stored as raw bytes: hashing and memcmp beat tuples and numpy calls


class CacheInvariantError(AssertionError):
    """The cache's bookkeeping disagrees with itself or with the allocator."""


def as_tokens(tokens) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.int32)
    if t.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {t.shape}")
    return t


def check_insert_args(tokens, pages, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise insert's arguments: whole pages only, one page per `page_size` tokens."""
    t = as_tokens(tokens)
    if len(t) % page_size:
        raise ValueError(
            f"insert takes whole pages: {len(t)} tokens is not a multiple of page_size={page_size}; "
            "the caller keeps (and later frees) the partial tail page"
        )
    p = np.asarray(pages, dtype=np.int32).ravel()
    if len(p) != len(t) // page_size:
        raise ValueError(f"{len(t)} tokens need {len(t) // page_size} pages, got {len(p)}")
    return t, p


class Node:
    """A node of the cache. `key`: the int32 token bytes it holds; `value`: its KV pages (None once evicted)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "namespace", "grown")

    def __init__(self, key: bytes, value: np.ndarray | None, parent: Node | None, last_access: int):
        self.children: dict[bytes, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.namespace: Hashable = None
        self.grown = 0  # the cache's clock when a child was last added below it (a match ending here may grow)

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int32)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        n = len(self.key) // TOKEN_BYTES
        return f"Node(tokens={n}, pages={0 if self.value is None else len(self.value)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix: its pages (tree-owned: lock `last_node` before relying on them)."""

    pages: np.ndarray
    last_node: Any  # pass to lock()/unlock(); a root (or None for NoCache) when nothing matched
    num_tokens: int


@runtime_checkable
class PrefixCache(Protocol):
    """What the scheduler needs from a prefix cache. Implemented by RadixCache, TableCache and NoCache."""

    allocator: PageAllocator
    page_size: int

    def match_prefix(self, tokens, extra_key: Hashable = None) -> MatchResult: ...

    def rematch(self, prev: MatchResult | None, tokens, extra_key: Hashable = None) -> MatchResult:
        """The same as match_prefix(tokens, extra_key); `prev` (an earlier match of the same tokens) may make it
        cheaper."""
        ...

    @property
    def clock(self) -> int: ...

    def unchanged_since(self, prev: MatchResult, clock: int, extra_key: Hashable = None) -> bool:
        """True only if match_prefix of prev's tokens would return prev now (prev taken when `clock` was read);
        then `touch(prev)` stands for that match."""
        ...

    def insert(self, tokens, pages, extra_key: Hashable = None, below: MatchResult | None = None) -> int:
        """`below` (a match of a prefix of `tokens` holding their first pages) may make it cheaper."""
        ...

    def lock(self, node) -> None: ...

    def unlock(self, node) -> None: ...

    def evict(self, num_pages: int) -> int: ...

    def flush(self) -> int: ...

    def reset(self) -> None: ...

    @property
    def evictable_pages(self) -> int: ...

    @property
    def protected_pages(self) -> int: ...

    def check_invariants(self, in_flight: int = 0) -> None: ...


def check_accounting(cache: PrefixCache, in_flight: int) -> None:
    """free + evictable + protected (+ pages that running requests hold outside the cache) == total."""
    a = cache.allocator
    lhs = a.num_free + cache.evictable_pages + cache.protected_pages + in_flight
    if lhs != a.capacity:
        raise CacheInvariantError(
            f"free {a.num_free} + evictable {cache.evictable_pages} + protected {cache.protected_pages} "
            f"+ in_flight {in_flight} = {lhs} != total {a.capacity}"
        )


class NodeStore:
    """Namespaced roots, locks, LRU eviction and accounting for a tree of page-holding nodes."""

    def __init__(self, allocator: PageAllocator, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = int(page_size)
        self._page_bytes = self.page_size * TOKEN_BYTES
        self._clock = 0
        self._new_tree()

    def _new_tree(self) -> None:
        self._roots: dict[Hashable, Node] = {}
        self.root = self._root(None)
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        # Lazy LRU heap of (last_access, seq, node): entries go stale when a node is touched, locked, gains a
        # child or is evicted, and are skipped on pop; a node is re-pushed whenever it becomes an evictable
        # leaf again. `seq` breaks ties so nodes are never compared.
        self._heap: list[tuple[int, int, Node]] = []
        self._seq = 0
        # Which pages the tree owns, to catch a page inserted twice before it corrupts the pool.
        self._owned = np.zeros(self.allocator.num_pages, dtype=bool)

    # -- accounting -------------------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def cached_pages(self) -> int:
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _root(self, extra_key: Hashable) -> Node:
        root = self._roots.get(extra_key)
        if root is None:
            root = Node(b"", EMPTY_PAGES, None, 0)
            root.namespace = extra_key
            self._roots[extra_key] = root
        return root

    def rematch(self, prev: MatchResult | None, tokens, extra_key: Hashable = None) -> MatchResult:
        return self.match_prefix(tokens, extra_key)  # a tree that cannot resume a match matches again

    @property
    def clock(self) -> int:
        """A count of the tree's operations: a match taken at clock c is current while `unchanged_since(m, c)`."""
        return self._clock

    def unchanged_since(self, prev: MatchResult, clock: int, extra_key: Hashable = None) -> bool:
        """Whether matching prev's tokens again would give prev (a tree that cannot tell answers False)."""
        return False

    # -- locks ------------------------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        """Protect `node` and its ancestors from eviction (one reference per running request)."""
        if node is None:
            return
        if node.value is None:
            raise ValueError("lock() on an evicted node: match again and lock the fresh result before evicting")
        while node.parent is not None:
            if node.lock_ref == 0:
                n = len(node.value)
                self._evictable -= n
                self._protected += n
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        if node is None:
            return
        leaf = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock() without a matching lock()")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.value)
                self._protected -= n
                self._evictable += n
            node = node.parent
        self._push_if_evictable(leaf)

    # -- eviction ---------------------------------------------------------------------------------------
    def _push_if_evictable(self, node: Node) -> None:
        if node.parent is not None and not node.children and node.lock_ref == 0 and node.value is not None:
            self._seq += 1
            heapq.heappush(self._heap, (node.last_access, self._seq, node))

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (whole leaves, least recently used first) if that many are evictable.

        Returns the number freed, which can exceed `num_pages` by the rest of the last leaf.
        """
        freed = 0
        heap = self._heap
        while freed < num_pages and heap:
            ts, _, node = heapq.heappop(heap)
            if node.value is None or node.children or node.lock_ref or node.last_access != ts:
                continue  # stale entry
            freed += self._delete_leaf(node)
        if len(heap) > 2 * self._num_nodes + 1024:
            self._rebuild_heap()
        return freed

    def flush(self) -> int:
        """Evict everything that is not locked. Returns pages freed."""
        return self.evict(self._evictable)

    def _delete_leaf(self, node: Node) -> int:
        pages = node.value
        self.allocator.free(pages)
        self._owned[pages] = False
        self._evictable -= len(pages)
        self._num_nodes -= 1
        parent = node.parent
        del parent.children[self._slot(node)]
        node.value = None
        if parent.parent is None:
            if not parent.children and parent.namespace is not None:
                del self._roots[parent.namespace]  # namespaces come and go (image hashes): don't keep empty roots
        else:
            self._push_if_evictable(parent)
        return len(pages)

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._nodes():
            self._push_if_evictable(node)

    # -- growing the tree -------------------------------------------------------------------------------
    def _slot(self, node: Node) -> bytes:
        """The key under which `node` sits in its parent's children dict."""
        raise NotImplementedError

    def _add_leaf(self, parent: Node, key: bytes, pages: np.ndarray, now: int) -> Node:
        if self._owned[pages].any() or not self.allocator.is_allocated(pages):
            raise ValueError("insert() got pages that are free, null, or already owned by the cache")
        leaf = Node(key, pages.copy(), parent, now)
        parent.children[self._slot(leaf)] = leaf
        parent.grown = now
        self._owned[pages] = True
        self._evictable += len(pages)
        self._num_nodes += 1
        self._push_if_evictable(leaf)
        return leaf

    def _free_duplicates(self, given: np.ndarray, cached: np.ndarray) -> None:
        """The caller computed KV that the cache already holds: keep the cache's pages, free the caller's.

        Pages equal to the cached ones are the cached pages themselves (the caller got them from match_prefix)
        and stay. A different page is the caller's own copy unless the cache owns it: in TableCache a caller may
        have matched a short entry and now insert under a longer one that was stored independently, so its
        matched pages differ from the longer chain's yet still belong to the short entry, which keeps them.
        """
        dup = (given != cached) & ~self._owned[given]
        if dup.any():
            self.allocator.free(given[dup])

    # -- whole-tree operations --------------------------------------------------------------------------
    def _nodes(self):
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        """Drop everything, returning every cached page to the allocator. Refuses while anything is locked."""
        if self._protected:
            raise ValueError(f"reset() with {self._protected} protected pages: unlock running requests first")
        nodes = list(self._nodes())
        if nodes:
            pages = np.concatenate([n.value for n in nodes])
            self.allocator.free(pages)
            for n in nodes:
                n.value = None
        self._new_tree()

    def check_invariants(self, in_flight: int = 0) -> None:
        """Recompute everything from scratch and compare. O(tree); for tests and idle-time checks.

        `in_flight`: pages that running requests hold outside the cache (allocated, not yet inserted).
        """
        evictable = protected = count = 0
        seen = []
        for root in self._roots.values():
            if root.lock_ref != 0 or len(root.value) != 0:
                raise CacheInvariantError("a root holds pages or a lock count")
        for node in self._nodes():
            count += 1
            if node.value is None:
                raise CacheInvariantError("an evicted node is still reachable")
            if node.parent.children.get(self._slot(node)) is not node:
                raise CacheInvariantError("child dict key or parent pointer is wrong")
            if len(node.value) == 0:
                raise CacheInvariantError("empty non-root node")
            child_locks = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < child_locks:
                raise CacheInvariantError("a node has fewer references than its children together")
            if node.last_access < max((c.last_access for c in node.children.values()), default=0):
                raise CacheInvariantError("a child was used more recently than its parent")
            self._check_node(node)
            seen.append(node.value)
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
        if (evictable, protected, count) != (self._evictable, self._protected, self._num_nodes):
            raise CacheInvariantError(
                f"counters (evictable {self._evictable}, protected {self._protected}, nodes {self._num_nodes}) "
                f"!= recount ({evictable}, {protected}, {count})"
            )
        pages = np.concatenate(seen) if seen else EMPTY_PAGES
        if len(np.unique(pages)) != len(pages):
            raise CacheInvariantError("a page is owned by two nodes")
        if not self.allocator.is_allocated(pages):
            raise CacheInvariantError("the tree holds a free or null page")
        owned = np.zeros_like(self._owned)
        owned[pages] = True
        if not np.array_equal(owned, self._owned):
            raise CacheInvariantError("ownership mask disagrees with the tree")
        check_accounting(self, in_flight)

    def _check_node(self, node: Node) -> None:
        """Subclass-specific structural checks for one node."""
