"""Prefix caches over the paged KV pool: RadixAttention's radix tree, its ablations, and the scheduling policies.

Host-side only (numpy); the KV pool itself lives on the device and is indexed by the pages handed out here.
"""

from sgjax.cache.allocator import NULL_PAGE, PageAllocator
from sgjax.cache.base import CacheInvariantError, MatchResult, Node, PrefixCache
from sgjax.cache.baselines import NoCache, TableCache
from sgjax.cache.optimal import optimal_computed_tokens, optimal_hit_rate
from sgjax.cache.policy import POLICIES, schedule_order
from sgjax.cache.radix import RadixCache
from sgjax.cache.simulate import SimConfig, SimResult, make_cache, simulate

__all__ = [
    "NULL_PAGE",
    "POLICIES",
    "CacheInvariantError",
    "MatchResult",
    "NoCache",
    "Node",
    "PageAllocator",
    "PrefixCache",
    "RadixCache",
    "SimConfig",
    "SimResult",
    "TableCache",
    "make_cache",
    "optimal_computed_tokens",
    "optimal_hit_rate",
    "schedule_order",
    "simulate",
]
