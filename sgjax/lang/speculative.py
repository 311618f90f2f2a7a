"""API speculative execution (the paper's Section 5): fewer calls to a black-box API for programs whose text
between gens is fixed.

    @sgl.function(num_api_spec_tokens=64)
    def extract(s, passage):
        s += passage + "\\nTopic:" + sgl.gen("topic", stop="\\n") + "\\nPlace:" + sgl.gen("place", stop="\\n")

Without speculation every gen is a call that sends the whole prompt again. With it, a gen's call ignores the gen's
stop strings and asks for `num_api_spec_tokens` tokens beyond the gen's max_tokens; the interpreter keeps the reply
(a `Reply`, anchored where it begins in the prompt state's text). The gen takes from it what its own call would
have returned, and every later gen of the stream first tries the reply: `answer` accepts it when

- everything appended since the anchor (earlier values, the fixed text between gens) is exactly the reply's
  beginning,
- the gen's sampling parameters, but for stop and max_tokens, equal those of the call,
- and the reply shows where the gen would have ended: a stop string completing within its max_tokens tokens (the
  value is the text before it, the stop string stays in the reply for the fixed text that follows), or
  max_tokens tokens of text, or the model's own end (EOS) before either.

Otherwise the gen makes its own call, again continuing past its stop, so the gens after it can still be matched.
Under greedy decoding the values equal those without speculation, up to tokenization: the reply holds the tokens
the model produced, a later call would tokenize the same text afresh.

The end of a gen is found the way the engine finds it (`sgjax/engine/detokenize.py`): the stop string that
completes first wins (the longest of those completing at the same character). Token counts come from the
backend's token ends (OpenAI: logprobs); a backend that does not report them gets no max_tokens check, so a gen
answered from its reply may be longer than its max_tokens.

Gens whose end free text cannot show are never speculated (constrained: regex, json_schema; min_tokens,
stop_token_ids, logprobs, max_tokens=0): they make their usual call, and their value is appended like fixed text.
A speculative program cannot stream (`run(stream=True)` raises): its later gens come out of one whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgjax.lang.backend.base import DEFAULT_MAX_NEW_TOKENS

NOT_SPECULATED = (
    "regex",
    "json_schema",
    "min_new_tokens",
    "stop_token_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
)
_NOT_SAMPLING = ("stop", "max_new_tokens")


@dataclass(frozen=True)
class Reply:
    anchor: int  # where the reply begins in the prompt state's text
    text: str
    token_ends: tuple[int, ...] | None  # end offset of each output token in `text`; None: unknown
    finished: bool  # the model ended it (EOS), not the token limit
    key: tuple  # the call's sampling parameters but stop and max_new_tokens


@dataclass(frozen=True)
class Answer:
    value: str
    tokens: int | None  # the tokens the gen's own call would have generated (None: unknown)
    finish_reason: dict  # as the runtime reports it: {"type": "stop", "matched": ...} or {"type": "length", ...}


def speculable(params: dict) -> bool:
    return not any(params.get(k) for k in NOT_SPECULATED) and params.get("max_new_tokens") != 0


def limit(params: dict) -> int:
    return params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)


def sampling_key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items() if k not in _NOT_SAMPLING))


def call_params(params: dict, num_spec_tokens: int) -> dict:
    """The speculative call: no stop strings, num_spec_tokens more tokens than the gen's own limit."""
    out = {k: v for k, v in params.items() if k != "stop"}
    out["max_new_tokens"] = limit(params) + num_spec_tokens
    return out


def make_reply(anchor: int, text: str, meta: dict, token_ends, params: dict) -> Reply:
    reason = (meta or {}).get("finish_reason") or {}
    ends = None
    if token_ends is not None:  # clipped and monotone: special tokens (EOS) may add no text
        ends, last = [], 0
        for e in token_ends:
            last = max(last, min(int(e), len(text)))
            ends.append(last)
        ends = tuple(ends)
    return Reply(anchor, text, ends, reason.get("type") == "stop", sampling_key(params))


def first_stop(text: str, stops, start: int = 0) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string that completes first in text[start:] (the longest of those that
    complete at the same character), as the engine's StopMatcher decides; None without one."""
    best = None
    for stop in dict.fromkeys(s for s in stops or () if s):
        pos = text.find(stop, start)
        if pos >= 0:
            key = (pos + len(stop), pos, stop)
            if best is None or key < best:
                best = key
    if best is None:
        return None
    end, pos, stop = best
    return pos, end, stop


def answer(reply: Reply, state_text: str, params: dict) -> Answer | str:
    """What the gen's own call would return, read off `reply`; or, when the reply cannot tell, why (a str)."""
    consumed = len(state_text) - reply.anchor
    if consumed < 0 or not reply.text.startswith(state_text[reply.anchor :]):
        said = reply.text[: max(consumed, 0)]
        at = next((i for i, (a, b) in enumerate(zip(said, state_text[reply.anchor :])) if a != b), len(said))
        return (
            f"the prompt since the reply began ({_clip(state_text[reply.anchor :])}) is not the reply's beginning "
            f"({_clip(said)}); they differ at character {at}"
        )
    if sampling_key(params) != reply.key:
        return "its sampling parameters differ from those of the speculative call"
    rest = reply.text[consumed:]
    m = limit(params)
    # The ends of the tokens that cover `rest`, relative to it (a token straddling the start counts for the gen).
    ends = None if reply.token_ends is None else [e - consumed for e in reply.token_ends if e > consumed]
    hit = first_stop(rest, params.get("stop"))
    if hit is not None:
        pos, end, stop = hit
        k = None if ends is None else next((i + 1 for i, e in enumerate(ends) if e >= end), None)
        if ends is None or (k is not None and k <= m):
            return Answer(rest[:pos], k, {"type": "stop", "matched": stop})
    if ends is not None and len(ends) >= m:  # m tokens before any stop string completes
        return Answer(rest[: ends[m - 1]], m, {"type": "length", "length": m})
    if reply.finished and hit is None:
        return Answer(rest, None if ends is None else len(ends), {"type": "stop", "matched": None})
    return f"the reply ends after {_clip(rest)} before the gen's stop string" + (
        "" if ends is None else f" or its {m} tokens"
    )


def _clip(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
