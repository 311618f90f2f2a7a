"""The n-gram drafter (`--speculative-algorithm NGRAM`): prompt lookup over the request's own tokens.

The last few tokens of a request (its prompt and output so far) are looked up earlier in the same sequence; the
tokens that followed the most recent earlier occurrence are the draft. Model-free, it drafts well where the answer
copies its context (retrieval, summaries, code edits, multi-turn chat) and drafts nothing elsewhere, which costs
nothing: a row with no draft decodes as usual. The longest n-gram (down to `min_match`) with an earlier occurrence
wins, as in vLLM's prompt lookup; what followed it is copied at the same offset, running on into the draft itself
when the occurrence is less than k tokens back (a loop drafts its whole period again).
"""

from __future__ import annotations

import numpy as np

MAX_MATCH = 4  # the longest suffix looked up
MIN_MATCH = 2  # shorter suffixes match by chance too often to be worth a verify row


def draft(tokens: np.ndarray, k: int, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of tokens' longest suffix (max_match down to
    min_match tokens long); [] when no suffix occurs earlier."""
    n = len(tokens)
    if k <= 0 or n < min_match + 1:
        return []
    for size in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - size :]
        # windows starting at 0 .. n - size - 1: every occurrence that ends before the suffix itself starts
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n - 1], size)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            # copy what followed, at the same offset: past the end that is the draft itself, so a loop of period p
            # drafts k tokens, not p
            out = tokens[int(hits[-1]) + size :].tolist()[:k]
            offset = n - (int(hits[-1]) + size)
            while len(out) < k:
                out.append(out[len(out) - offset])
            return out
    return []
