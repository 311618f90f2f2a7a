"""Algorithm 1 (paper appendix A.2) on the cache alone: no model, just which prompt tokens get computed.

Each step matches every waiting request, orders them with a policy, admits them in that order while pages can
be allocated (evicting LRU leaves when needed), "runs" the batch, then inserts each finished request into the
cache and drops its reference. Decoding is not modelled: a request is its prompt. A full hit counts every
prompt token as cached, as in Theorem 3.1 (an engine still recomputes one token for the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from sgjax.cache.allocator import PageAllocator
from sgjax.cache.base import PrefixCache
from sgjax.cache.baselines import NoCache, TableCache
from sgjax.cache.policy import POLICIES, schedule_order
from sgjax.cache.radix import RadixCache

CACHES = {"radix": RadixCache, "table": TableCache, "none": NoCache}


def make_cache(kind: str, allocator: PageAllocator, page_size: int = 1) -> PrefixCache:
    """A cache by name: radix (RadixAttention), table (no tree), none (no reuse)."""
    try:
        return CACHES[kind](allocator, page_size)
    except KeyError:
        raise ValueError(f"unknown cache {kind!r}; choose from {tuple(CACHES)}") from None


@dataclass(frozen=True)
class SimConfig:
    capacity_tokens: int  # KV pool size (cache and running requests share it), rounded up to whole pages
    policy: str = "lpm"
    cache: str = "radix"
    page_size: int = 1
    max_batch_requests: int = 1  # 1 = one request at a time, the setting of Theorem 3.1
    seed: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICIES}")
        if self.cache not in CACHES:
            raise ValueError(f"unknown cache {self.cache!r}; choose from {tuple(CACHES)}")


@dataclass(frozen=True)
class SimResult:
    computed_tokens: int
    cached_tokens: int
    order: tuple[int, ...]  # request indices in the order they ran
    steps: int

    @property
    def total_tokens(self) -> int:
        return self.computed_tokens + self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.total_tokens if self.total_tokens else 0.0


def simulate(
    requests: Sequence[Sequence[int]], config: SimConfig, extra_keys: Sequence[Hashable] | None = None
) -> SimResult:
    S = config.page_size
    toks = [np.asarray(r, dtype=np.int32) for r in requests]
    keys = list(extra_keys) if extra_keys is not None else [None] * len(toks)
    allocator = PageAllocator(-(-config.capacity_tokens // S) + 1)
    cache = make_cache(config.cache, allocator, S)
    rng = np.random.default_rng(config.seed)
    waiting = list(range(len(toks)))
    computed = cached = steps = 0
    order: list[int] = []
    while waiting:
        matches = [cache.match_prefix(toks[i], keys[i]) for i in waiting]
        ranked = schedule_order(config.policy, [m.num_tokens for m in matches], [m.last_node for m in matches], rng)
        batch = []
        for j in ranked:
            if len(batch) == config.max_batch_requests:
                break
            i = waiting[j]
            # Match again: admitting earlier requests may have evicted or split what the first match returned.
            m = cache.match_prefix(toks[i], keys[i])
            cache.lock(m.last_node)
            need = -(-len(toks[i]) // S) - len(m.pages)
            if allocator.num_free < need:
                cache.evict(need - allocator.num_free)
            pages = allocator.alloc(need)
            if pages is None:
                cache.unlock(m.last_node)
                break
            batch.append((i, m, pages))
        if not batch:
            raise RuntimeError(f"request {waiting[ranked[0]]} does not fit in {config.capacity_tokens} tokens")
        for i, m, pages in batch:
            computed += len(toks[i]) - m.num_tokens
            cached += m.num_tokens
            full = len(toks[i]) // S
            allp = np.concatenate([m.pages, pages])
            cache.insert(toks[i][: full * S], allp[:full], keys[i])
            allocator.free(allp[full:])  # the partial tail page is not shareable
            cache.unlock(m.last_node)
            order.append(i)
        done = {i for i, _, _ in batch}
        waiting = [i for i in waiting if i not in done]
        steps += 1
    cache.check_invariants()
    return SimResult(computed, cached, tuple(order), steps)
