"""Completion within a token budget: the fewest tokens from each FSM state to a complete match, and the mask that
keeps one reachable.

A constrained request with `max_new_tokens` must not end mid-match (a tool call whose arguments stop inside a
string, a JSON body missing its closing braces). `tokens_to_finish(tables, mask)` counts, per state, the fewest
tokens (EOS included where the grammar needs it) to a finished output: a breadth-first search backwards from the
finished states over the token graph the mask allows. At a step with `remaining` tokens left, a row may take only
the tokens whose next state can still finish in `remaining - 1`: once the budget binds, the mask steers the output
to close its strings, arrays and objects, and never opens another parallel call it cannot finish. While
`remaining` exceeds every successor's count the mask is the grammar's own (`binds`), so unbudgeted decoding is
unchanged. A request whose start already needs more than its budget cannot finish; it decodes as before and ends
with finish_reason "length" (the API layer returns no call built from the truncated text).
"""

from __future__ import annotations

import numpy as np

from sgjax.fsm.token_fsm import TokenTables, pack_mask

UNREACHABLE = np.iinfo(np.int32).max


def tokens_to_finish(tables: TokenTables, canonical: np.ndarray, finished: np.ndarray) -> np.ndarray:
    """int32[S + 1]: per state the fewest tokens to a finished state (0 there; UNREACHABLE where none is). The
    edges are the mask's: every allowed token class, or only the canonical token's class where a state has one
    (compressed.canonical_tokens). `finished`: bool[S + 1], the states a request ends in without another token."""
    nxt = tables.class_next.copy()
    canon_rows = np.flatnonzero(canonical >= 0)
    if canon_rows.size:  # a forced state: its canonical token alone
        keep = tables.token_class[canonical[canon_rows]]
        only = nxt[canon_rows, keep]
        nxt[canon_rows] = -1
        nxt[canon_rows, keep] = only
    src, cls = np.nonzero(nxt >= 0)
    dst = nxt[src, cls]
    order = np.argsort(dst, kind="stable")  # reverse adjacency: the sources of each destination
    src, dst = src[order], dst[order]
    starts = np.searchsorted(dst, np.arange(tables.num_states + 1))
    dist = np.full(tables.num_states, UNREACHABLE, np.int32)
    frontier = np.flatnonzero(finished)
    dist[frontier] = 0
    step = 0
    while frontier.size:
        step += 1
        lo, hi = starts[frontier], starts[frontier + 1]
        lengths = hi - lo
        at = np.repeat(lo - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        preds = np.unique(src[at])
        preds = preds[dist[preds] == UNREACHABLE]
        dist[preds] = step
        frontier = preds
    return dist


def successor_ceiling(tables: TokenTables, canonical: np.ndarray, dist: np.ndarray) -> np.ndarray:
    """int32[S + 1]: per state the largest finite count among its allowed successors: a budget of more than this
    plus one never changes the state's mask."""
    nxt = tables.class_next
    counts = np.where(nxt >= 0, dist[np.maximum(nxt, 0)], -1)
    counts = np.where(counts == UNREACHABLE, -1, counts)
    out = counts.max(axis=1)
    rows = np.flatnonzero(canonical >= 0)
    if rows.size:
        out[rows] = dist[nxt[rows, tables.token_class[canonical[rows]]]]
    return out.astype(np.int32)


def budget_mask(
    tables: TokenTables, mask_bits: np.ndarray, canonical: np.ndarray, dist: np.ndarray, state: int, remaining: int
) -> np.ndarray:
    """int32[ceil(V / 32)]: the state's mask keeping only the tokens after which `remaining - 1` tokens can still
    finish. Empty when none can (the caller keeps the grammar's own mask then)."""
    canon = int(canonical[state])
    if canon >= 0:
        ok = dist[tables.next_state(state, canon)] <= remaining - 1
        return mask_bits[state] if ok else np.zeros_like(mask_bits[state])
    nxt = tables.class_next[state]
    classes = (nxt >= 0) & (dist[np.maximum(nxt, 0)] <= remaining - 1)
    return pack_mask(classes[tables.token_class][None, :])[0]
