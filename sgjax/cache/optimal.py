"""Theorem 3.1: the fewest prompt tokens any schedule must compute for a batch of requests.

Every edge of the requests' radix tree has to be computed at least once, and DFS order over the tree (with a
cache at least as large as the longest request) computes each exactly once, so the minimum is the sum of the
edge lengths. That sum equals the number of distinct prefixes, which we count without building a tree: sort the
sequences and subtract each one's longest common prefix with its predecessor. Being independent of
RadixCache, it also serves the tests as an oracle.

With page_size S only whole pages are shareable: each request's partial tail page is always computed.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence

import numpy as np


def _common_prefix(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n])
    neq = x != np.asarray(b[:n])
    return int(neq.argmax()) if neq.any() else n


def optimal_computed_tokens(
    seqs: Sequence[Sequence[int]], page_size: int = 1, extra_keys: Sequence[Hashable] | None = None
) -> int:
    """Minimum number of prompt tokens that must be computed for `seqs` (sum of the radix tree's edge lengths)."""
    S = page_size
    groups: dict[Hashable, list[tuple]] = defaultdict(list)
    tails = 0
    for i, s in enumerate(seqs):
        full = len(s) // S * S
        tails += len(s) - full
        groups[None if extra_keys is None else extra_keys[i]].append(tuple(int(x) for x in s[:full]))
    distinct_tokens = 0
    for keys in groups.values():
        keys.sort()
        prev: tuple = ()
        for k in keys:
            distinct_tokens += len(k) - _common_prefix(prev, k) // S * S
            prev = k
    return distinct_tokens + tails


def optimal_hit_rate(
    seqs: Sequence[Sequence[int]], page_size: int = 1, extra_keys: Sequence[Hashable] | None = None
) -> float:
    """Best achievable cache hit rate (cached prompt tokens / prompt tokens) for the batch, starting cold."""
    total = sum(len(s) for s in seqs)
    if total == 0:
        return 0.0
    return 1.0 - optimal_computed_tokens(seqs, page_size, extra_keys) / total


def optimal_prompt_tokens_with_outputs(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], page_size: int = 1
) -> int:
    """The Theorem 3.1 minimum for LM programs, where later prompts extend earlier requests' outputs.

    A program's next call sends back what an earlier call decoded (a fork after a gen, the next turn of a chat), so
    those tokens' KV was computed by decoding and a cache can serve them to the later prompt without any prefill.
    Every page-aligned prefix of the prompts must still be computed once, unless it ends inside a request's decoded
    tokens (prompt + output without its last token, whose KV is never computed); partial tail pages always are.
    Prefixes are keyed by a chained hash per page, so the cost is linear in the tokens."""
    S = page_size

    def page_keys(seq):
        key = None
        for k in range(len(seq) // S):
            key = hash((key, tuple(seq[k * S : (k + 1) * S])))
            yield k + 1, key

    decoded: set = set()
    for p, o in zip(prompts, outputs):
        full = [int(t) for t in p] + [int(t) for t in o[:-1]]
        decoded.update(key for pages, key in page_keys(full) if pages * S > len(p))
    seen: set = set()
    computed = 0
    for p in prompts:
        ids = [int(t) for t in p]
        for pages, key in page_keys(ids):
            if key not in seen and key not in decoded:
                computed += S
            seen.add(key)
        computed += len(ids) % S
    return computed
