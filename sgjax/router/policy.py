"""Dispatch policies: which worker gets a request. Pure objects over a snapshot of the workers (`WorkerView`), so
they are tested without HTTP; the router calls `select`, then `on_dispatch` once the request is sent.

- cache_aware (default, after SGLang's router): the worker holding the longest prefix of the prompt in the meta-tree,
  if that covers more than `cache_threshold` of the prompt and the load is balanced; otherwise the least-loaded
  worker. Load is imbalanced when both max - min > balance_abs_threshold and max > balance_rel_threshold * min
  (in-flight requests), so a hot prefix cannot pile every request onto one worker while others idle.
- round_robin: workers in turn.
- shortest_queue: the fewest in-flight requests.
- random: uniformly at random (seeded).

Ties between equally loaded workers go to the one dispatched fewest requests so far (then the first): with idle
workers and requests one at a time, "least loaded" would otherwise always mean worker 0.
"""

from __future__ import annotations

import random as _random
from dataclasses import dataclass
from typing import Sequence

from sgjax.router.meta_tree import MetaTree

POLICIES = ("cache_aware", "round_robin", "shortest_queue", "random")


@dataclass(frozen=True)
class WorkerView:
    url: str
    in_flight: int = 0  # requests sent and not yet answered in full
    dispatched: int = 0  # requests sent so far


@dataclass(frozen=True)
class Choice:
    url: str
    reason: str  # "cache", "balance", "load", "round_robin", "random"
    matched: int = 0  # prompt elements (characters or ids) the worker is believed to hold


PromptKey = tuple  # (kind, key): ("text", str) or ("ids", tuple of ints); see keys.py


class Policy:
    name = "base"

    def select(self, workers: Sequence[WorkerView], key: PromptKey | None) -> Choice:
        raise NotImplementedError

    # Hooks for policies with state about the workers' caches (cache_aware); no-ops elsewhere.
    def on_dispatch(self, url: str, key: PromptKey | None) -> None:
        pass

    def forget(self, url: str) -> None:
        """The worker's cache is gone or unreachable (down, restarted, flushed)."""

    def clear(self) -> None:
        """Every worker's cache was flushed."""

    def set_capacity(self, url: str, tokens: int) -> None:
        pass

    def observe(self, chars: int, tokens: int) -> None:
        pass

    def stats(self) -> dict:
        return {}


def least_loaded(workers: Sequence[WorkerView], tiebreak=None) -> WorkerView:
    """Fewest in-flight requests; then `tiebreak(view)` (smaller first) if given; then fewest dispatched; then the
    first."""

    def rank(iv):
        i, w = iv
        return (w.in_flight, tiebreak(w) if tiebreak else 0, w.dispatched, i)

    return min(enumerate(workers), key=rank)[1]


def imbalanced(loads: Sequence[int], abs_threshold: float, rel_threshold: float) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def select(self, workers, key):
        w = workers[self._next % len(workers)]
        self._next += 1
        return Choice(w.url, "round_robin")


class ShortestQueue(Policy):
    name = "shortest_queue"

    def select(self, workers, key):
        return Choice(least_loaded(workers).url, "load")


class Random(Policy):
    name = "random"

    def __init__(self, seed: int | None = 0):
        self._rng = _random.Random(seed)

    def select(self, workers, key):
        return Choice(self._rng.choice(list(workers)).url, "random")


class CacheAware(Policy):
    name = "cache_aware"

    # SGLang router's defaults.
    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.0001,
        tree: MetaTree | None = None,
    ):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tree = tree if tree is not None else MetaTree()
        self.decisions = {"cache": 0, "balance": 0, "load": 0}

    def select(self, workers, key):
        choice = self._choose(workers, key)
        self.decisions[choice.reason] += 1
        return choice

    def _choose(self, workers, key) -> Choice:
        by_url = {w.url: w for w in workers}
        matched = self.tree.match(key[0], key[1], by_url) if key else {}
        tree_size = lambda w: self.tree.tokens(w.url)  # noqa: E731 - least used cache first, as SGLang's router
        if imbalanced([w.in_flight for w in workers], self.balance_abs_threshold, self.balance_rel_threshold):
            w = least_loaded(workers, tree_size)
            return Choice(w.url, "balance", matched.get(w.url, 0))
        if matched and len(key[1]):
            best = max(matched.values())
            if best / len(key[1]) > self.cache_threshold:
                w = least_loaded([by_url[u] for u, m in matched.items() if m == best], tree_size)
                return Choice(w.url, "cache", best)
        w = least_loaded(workers, tree_size)
        return Choice(w.url, "load", matched.get(w.url, 0))

    def on_dispatch(self, url, key):
        if key:
            self.tree.insert(key[0], key[1], url)

    def forget(self, url):
        self.tree.remove_worker(url)

    def clear(self):
        self.tree.clear()

    def set_capacity(self, url, tokens):
        self.tree.capacity[url] = tokens

    def observe(self, chars, tokens):
        self.tree.observe(chars, tokens)

    def stats(self):
        t = self.tree
        return {
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "decisions": dict(self.decisions),
            "meta_tree": {
                "nodes": t.num_nodes(),
                "chars_per_token": round(t.chars_per_token, 3),
                "tokens": {w: round(t.tokens(w), 1) for w in t.workers()},
                "capacity": dict(t.capacity),
            },
        }


def make_policy(name: str, **cache_aware_args) -> Policy:
    if name == "cache_aware":
        return CacheAware(**cache_aware_args)
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "random":
        return Random()
    raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
