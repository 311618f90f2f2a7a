"""Speculative decoding's host side (`--speculative-algorithm NGRAM`): the n-gram drafter (prompt lookup over the
request's own tokens), which rows may draft, and the accept rule of a verified draft. The scheduler calls these;
the runner samples a draft's rows (docs/engine.md, "Speculative decoding verifies by sampling").

The last few tokens of a request (its prompt and output so far) are looked up earlier in the same sequence; the
tokens that followed the most recent earlier occurrence are the draft. Model-free, it drafts well where the answer
copies its context (retrieval, summaries, code edits, multi-turn chat) and drafts nothing elsewhere, which costs
nothing: a row with no draft decodes as usual. The longest n-gram (down to `min_match`) with an earlier occurrence
wins, as in vLLM's prompt lookup; what followed it is copied at the same offset, running on into the draft itself
when the occurrence is less than k tokens back (a loop drafts its whole period again).
"""

from __future__ import annotations

import numpy as np

from sgjax.engine.params import uses_penalties
from sgjax.engine.work import Work

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


def room(req, width: int) -> int:
    """Tokens a decoding request may draft when it verifies at most `width` (its last one included): within its
    token budget; none for rows whose sampling reads the tokens before it on the host (penalty windows, logit
    bias, min_new_tokens) or whose last token is still on the device (overlap)."""
    p = req.params
    k = min(width - 1, p.max_new_tokens - len(req.output_ids) - 1)
    if k <= 0 or req.output_ids[-1] < 0 or uses_penalties(p) or p.logit_bias:
        return 0
    return 0 if len(req.output_ids) < p.min_new_tokens else k


def draft_for(req, width: int) -> tuple[list[int], list[int]]:
    """(draft, grammar states) for a decoding request verifying at most `width` tokens (`room`), by prompt
    lookup; `constrained` cuts it under a grammar."""
    k = room(req, width)
    if k == 0:
        return [], []
    return constrained(req, draft(np.concatenate([req.input_array, np.asarray(req.output_ids, np.int32)]), k))


def constrained(req, drafted: list[int]) -> tuple[list[int], list[int]]:
    """(draft, grammar states): under a grammar the draft ends before its first token the grammar forbids, and the
    states are the grammar's at each of the draft's rows (empty without a grammar)."""
    if req.grammar is None or not drafted:
        return drafted, []
    states = [req.fsm_state]
    for t in drafted:
        state = req.grammar.next_state(states[-1], t)
        if state < 0:
            break
        states.append(state)
    drafted = drafted[: len(states) - 1]
    return drafted, (states if drafted else [])


def with_model_drafts(works: list, drafter) -> list:
    """The planned verify rows' drafts from a model on the device (drafter: works -> drafted tokens, Runner.draft)
    in place of their placeholders, cut under a grammar; a row left with none decodes as usual."""
    pending = [w for w in works if w.draft]
    if not pending:
        return works
    drafted = dict(zip(map(id, pending), drafter(pending)))
    out = []
    for w in works:
        if not w.draft:
            out.append(w)
            continue
        tokens, states = constrained(w.req, drafted[id(w)][: len(w.draft)])
        if tokens:
            out.append(Work(w.req, w.start, [w.tokens[0], *tokens], sample=True, draft=tokens, fsm_states=states))
        else:
            out.append(Work(w.req, w.start, w.tokens[:1], sample=True, decode=True))
    return out


def accepted(drafted: list[int], sampled: list[int]) -> int:
    """How many drafted tokens stand: row i sampled the token decoding would sample after the first i drafted
    tokens (same logits, seed and step), so a drafted token stands while it equals its row's sample."""
    n = 0
    while n < len(drafted) and sampled[n] == drafted[n]:
        n += 1
    return n


# built: NGRAM (prompt lookup, here), SELF (the target's first layers draft) and STANDALONE (a smaller model drafts:
# engine/drafter.py); SGLang's others are refused by name
ALGORITHMS = ("NGRAM", "SELF", "STANDALONE")


def num_draft_tokens(args) -> int:
    """The verify width from the speculative flags (0: off); a draft model's algorithm is refused by name."""
    algo = args.speculative_algorithm
    if algo is None:
        return 0
    if algo.upper() not in ALGORITHMS:
        raise ValueError(
            f"speculative_algorithm {algo!r} is not built in sgjax (built: {', '.join(ALGORITHMS)}); "
            "EAGLE, EAGLE3 and NEXTN (draft heads trained for the target) are not built"
        )
    if args.speculative_num_draft_tokens < 2:
        raise ValueError(
            f"speculative_num_draft_tokens must be >= 2 (the last token and one drafted), got "
            f"{args.speculative_num_draft_tokens}"
        )
    return args.speculative_num_draft_tokens


def commit_draft(w, token: int, logprob: float, top, stats) -> None:
    """Record a verified draft (engine/scheduler.commit): the drafted tokens that stand (`accepted`), then the
    sample of the row after them (the last row's when all stand). The rejected rows' KV lies past kv_len, where the
    next tokens overwrite it. `stats`: the scheduler's Stats (speculation counters)."""
    req = w.req
    sampled = [t for t, _, _ in w.draft_results] + [token]
    n = accepted(w.draft, sampled)
    new = sampled[: n + 1]
    req.kv_len = w.start + 1 + n
    req.output_ids.extend(new)
    req.new_tokens = len(new)
    if req.return_logprob:
        rows = w.draft_results[: n + 1] + ([(token, logprob, top)] if n == len(w.draft) else [])
        req.output_logprobs.extend((float(lp), t) for t, lp, _ in rows)
        req.output_top_logprobs.extend(tops for _, _, tops in rows)
    req.spec_steps += 1
    req.spec_accepted += n
    stats.spec_rows, stats.spec_drafted, stats.spec_accepted = (
        stats.spec_rows + 1,
        stats.spec_drafted + len(w.draft),
        stats.spec_accepted + n,
    )
