"""Orders for the waiting queue (paper Algorithm 1 and its ablations), as pure functions over match results.

The scheduler matches every waiting request against the cache, asks `schedule_order` for an order, then admits
requests in that order while free + evictable pages last. Policies:
  lpm         longest prefix match first (ties keep arrival order): the paper's cache-aware order.
  dfs-weight  DFS over the matched nodes, heavier subtrees (more waiting requests) first (SGLang's variant).
  fcfs        arrival order.
  random      a fresh random permutation per call.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

POLICIES = ("lpm", "dfs-weight", "fcfs", "random")


def lpm_order(match_lens: Sequence[int]) -> list[int]:
    return sorted(range(len(match_lens)), key=lambda i: -match_lens[i])


def dfs_weight_order(last_nodes: Sequence) -> list[int]:
    """Requests sorted by a DFS of the cache from its roots, visiting the child with most waiting requests
    below it first; a node's own requests come after its subtree's (deeper matches first, as in SGLang).

    `last_nodes[i]` is MatchResult.last_node of request i (anything with a `.parent`; None means no match).
    """
    weight: dict = defaultdict(int)
    kids: dict = defaultdict(list)
    at_node: dict = defaultdict(list)
    for i, node in enumerate(last_nodes):
        at_node[node].append(i)
        while node is not None:
            if weight[node] == 0:
                parent = getattr(node, "parent", None)
                kids[parent].append(node)
            weight[node] += 1
            node = getattr(node, "parent", None)
    order: list[int] = []
    # Iterative post-order so deep trees cannot hit the recursion limit.
    stack = [(None, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.extend(at_node.get(node, ()))
            continue
        stack.append((node, True))
        # Pushed lightest first so the heaviest pops first; ties pop in arrival order.
        for child in sorted(reversed(kids.get(node, ())), key=lambda c: weight[c]):
            stack.append((child, False))
    return order


def schedule_order(
    policy: str,
    match_lens: Sequence[int],
    last_nodes: Sequence | None = None,
    rng: np.random.Generator | None = None,
) -> list[int]:
    """Indices of the waiting requests in the order they should be admitted."""
    n = len(match_lens)
    if policy == "lpm":
        return lpm_order(match_lens)
    if policy == "dfs-weight":
        if last_nodes is None or len(last_nodes) != n:
            raise ValueError("dfs-weight needs one last_node per request")
        return dfs_weight_order(last_nodes)
    if policy == "fcfs":
        return list(range(n))
    if policy == "random":
        return (rng or np.random.default_rng()).permutation(n).tolist()
    raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
