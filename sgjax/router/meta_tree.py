"""The router's meta-tree (the paper's Appendix A.4): one radix tree over prompts, each node recording which workers
hold that prefix, so a request can go to the worker whose cache already holds most of it.

Keys. A text request is keyed by the characters of its text, an `input_ids` request by its token ids, each kind
in its own sub-tree (they never match each other). The router has no tokenizer on purpose: tokenizing every request
would put a model's tokenizer and its CPU cost in front of all workers, and characters match the same shared
prefixes that tokens do (a shared text prefix is a shared token prefix up to the last token or two). Chat messages
are serialised to text (`keys.py`).

Sizes. Each worker's picture is bounded by its KV pool (`max_total_tokens` from its /get_server_info). Token ids
count one each; characters count 1 / chars_per_token each, a ratio the router learns from the workers' answers
(`observe`). When an insert takes a worker's picture over its bound, that worker's least recently used leaves are
dropped until it fits, which is roughly what the worker's own radix cache does (LRU over unlocked leaves). The two
pictures are not synchronised and may drift (docs/router.md): the paper's weakly consistent design.

Each non-root node has at least one worker, and a worker at a node is at its parent too (prefix closure); a worker's
access tick at a node is never older than at any of its descendants, so its oldest leaf is always safe to drop.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from typing import Sequence

KINDS = ("text", "ids")
DEFAULT_CHARS_PER_TOKEN = 4.0  # English BPE text, until the workers' answers say otherwise


class Node:
    __slots__ = ("edge", "children", "parent", "workers")

    def __init__(self, edge, parent: "Node | None"):
        self.edge = edge  # str (text) or tuple of ints (ids): the keys between the parent and this node
        self.children: dict = {}  # first element of the child's edge -> child
        self.parent = parent
        self.workers: dict[str, int] = {}  # worker -> access tick


class MetaTree:
    def __init__(self, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN):
        self._clock = itertools.count(1)  # a logical clock, not wall time: ordering is all LRU needs
        self._seq = itertools.count()  # heap tie-breaker
        self.capacity: dict[str, float] = {}  # worker -> tokens; absent: unbounded
        self._chars, self._tokens = 0, 0  # observed text prompts: characters and their token counts
        self._default_cpt = chars_per_token
        self.clear()

    # -- queries ---------------------------------------------------------------------------------------------
    def match(self, kind: str, key: Sequence, workers: Sequence[str] | None = None) -> dict[str, int]:
        """Length of the longest prefix of `key` each worker holds (workers with none are absent). A match may end
        inside an edge: the worker holds that edge's first characters too."""
        node, pos, best = self._roots[kind], 0, {}
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common(child.edge, key, pos)
            for w in child.workers:  # deeper nodes hold a subset of these workers: the last write is the deepest
                best[w] = pos + n
            if n < len(child.edge):
                break
            node, pos = child, pos + n
        if workers is not None:
            best = {w: m for w, m in best.items() if w in workers}
        return best

    @property
    def chars_per_token(self) -> float:
        return self._chars / self._tokens if self._tokens else self._default_cpt

    def tokens(self, worker: str) -> float:
        """The worker's picture in estimated tokens."""
        size = self._size[worker]
        return size["ids"] + size["text"] / self.chars_per_token

    def workers(self) -> list[str]:
        return [w for w, size in self._size.items() if size["ids"] or size["text"]]

    def num_nodes(self) -> int:
        return sum(1 for kind in KINDS for _ in _walk(self._roots[kind])) - len(KINDS)

    # -- updates ---------------------------------------------------------------------------------------------
    def insert(self, kind: str, key: Sequence, worker: str) -> None:
        """`worker` now holds `key` (it was dispatched there): mark the path, refresh its access tick, then drop
        the worker's least recently used leaves while its picture is over its capacity."""
        if not len(key):
            return
        tick = next(self._clock)
        node, pos = self._roots[kind], 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                child = Node(key[pos:], node)
                node.children[key[pos]] = child
            else:
                n = _common(child.edge, key, pos)
                if n < len(child.edge):
                    child = self._split(child, n)
            self._mark(child, worker, tick, kind)
            node, pos = child, pos + len(child.edge)
        heapq.heappush(self._heaps[worker], (tick, next(self._seq), node, kind))
        self.evict(worker)

    def evict(self, worker: str) -> None:
        """Drop the worker's oldest leaves until its picture fits its capacity."""
        cap = self.capacity.get(worker)
        heap = self._heaps[worker]
        while cap is not None and heap and self.tokens(worker) > cap:
            tick, _, node, kind = heapq.heappop(heap)
            if node.workers.get(worker) == tick and not self._holds_below(node, worker):
                self._drop(node, worker, kind)

    def remove_worker(self, worker: str) -> None:
        """Forget everything about a worker (it went down, or its cache was flushed)."""
        for kind in KINDS:
            for node in reversed(list(_walk(self._roots[kind]))):  # children before parents
                if worker in node.workers:
                    self._drop(node, worker, kind)
        self._size.pop(worker, None)
        self._heaps.pop(worker, None)

    def clear(self) -> None:
        self._roots = {"text": Node("", None), "ids": Node((), None)}
        self._size: dict[str, dict[str, int]] = defaultdict(lambda: {"text": 0, "ids": 0})
        self._heaps: dict[str, list] = defaultdict(list)

    def observe(self, chars: int, tokens: int) -> None:
        """A text prompt of `chars` characters was `tokens` tokens on a worker: refines chars_per_token."""
        if chars > 0 and tokens > 0:
            self._chars += chars
            self._tokens += tokens

    # -- internals -------------------------------------------------------------------------------------------
    def _split(self, child: Node, n: int) -> Node:
        """Cut child's edge after n elements; the new upper node keeps child's workers and ticks (sizes are
        unchanged: each worker holds the same elements, in two nodes now)."""
        parent = child.parent
        upper = Node(child.edge[:n], parent)
        upper.workers = dict(child.workers)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _mark(self, node: Node, worker: str, tick: int, kind: str) -> None:
        if worker not in node.workers:
            self._size[worker][kind] += len(node.edge)
        node.workers[worker] = tick

    def _holds_below(self, node: Node, worker: str) -> bool:
        return any(worker in c.workers for c in node.children.values())

    def _drop(self, node: Node, worker: str, kind: str) -> None:
        """Remove a worker from a node it holds as a leaf; a node nobody holds leaves the tree (its subtree is
        empty by prefix closure); a parent that becomes the worker's leaf becomes evictable."""
        del node.workers[worker]
        self._size[worker][kind] -= len(node.edge)
        parent = node.parent
        if not node.workers:
            del parent.children[node.edge[0]]
            node.parent = None
        if parent.parent is not None and worker in parent.workers and not self._holds_below(parent, worker):
            heapq.heappush(self._heaps[worker], (parent.workers[worker], next(self._seq), parent, kind))

    def check(self) -> None:
        """Invariants (tests): prefix closure, ticks never newer below, no empty nodes, sizes recounted."""
        sizes: dict = defaultdict(lambda: {"text": 0, "ids": 0})
        for kind in KINDS:
            for node in _walk(self._roots[kind]):
                for key, child in node.children.items():
                    assert child.parent is node and child.edge and child.edge[0] == key
                    assert child.workers, "a node nobody holds"
                    for w, t in child.workers.items():
                        if node.parent is not None:
                            assert w in node.workers and node.workers[w] >= t, "prefix closure / ticks"
                        sizes[w][kind] += len(child.edge)
        assert {w: s for w, s in sizes.items()} == {w: s for w, s in self._size.items() if s["text"] or s["ids"]}


def _common(edge, key, pos: int) -> int:
    if key[pos : pos + len(edge)] == edge:  # the usual case, compared in C
        return len(edge)
    n, limit = 0, min(len(edge), len(key) - pos)
    while n < limit and edge[n] == key[pos + n]:
        n += 1
    return n


def _walk(root: Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())
