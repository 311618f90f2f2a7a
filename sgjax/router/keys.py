"""What the router reads in a request body: its meta-tree key, ("text", characters) or ("ids", token ids), or None;
and its data-parallel rank, if it names one.

The router validates no other field (the worker does, and answers a 400 naming the field, which passes through): a
body it cannot read has no key and goes to the least-loaded worker. A batch goes to one worker (its answer is one
response), keyed by its first prompt. Chat messages become one string, each message serialised on its own and
concatenated, so a conversation's next turn extends the previous turn's key exactly as its prompt extends the
previous prompt.
"""

from __future__ import annotations

import json

from sgjax.router.policy import PromptKey
from sgjax.server.protocol import ApiError

# SGLang's name for the rank, then its older one, which sglang-router --dp-aware sets (it reads the router's dp_size,
# the number of workers, from /server_info, and sends rank r of each request to the router's URL)
RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")


def requested_rank(body: bytes, workers: int) -> tuple[int | None, bytes]:
    """The worker a body asks for by data-parallel rank (the index of a worker in the router's list), and the body
    without the rank fields: each worker is one engine, rank 0 of its own. (None, body) when it names no rank or
    cannot be read (the worker answers that 400). A rank that is not one of the workers' is a 400 naming the field;
    `routed_dp_rank` wins over `data_parallel_rank`, as in SGLang."""
    if not any(f.encode() in body for f in RANK_FIELDS):  # most bodies: not parsed a second time
        return None, body
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None, body
    if not isinstance(obj, dict):
        return None, body
    name = next((f for f in RANK_FIELDS if obj.get(f) is not None), None)
    if name is None:
        return None, body
    rank = obj[name]
    if type(rank) is not int or not 0 <= rank < workers:
        raise ApiError(
            f"{name}: out of range [0, {workers}): {json.dumps(rank)} is not a rank of this router's {workers} workers",
            param=name,
        )
    for f in RANK_FIELDS:
        obj.pop(f, None)
    return rank, json.dumps(obj, ensure_ascii=False).encode()


def prompt_key(path: str, body: bytes) -> PromptKey | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    if path == "/generate":
        return _prompt(obj.get("text")) or _prompt(obj.get("input_ids"))
    if path == "/v1/completions":
        return _prompt(obj.get("prompt"))
    if path == "/v1/chat/completions":
        return _messages(obj.get("messages"))
    return None


def _prompt(value) -> PromptKey | None:
    """A string, a list of strings, a list of ids or a list of id lists: the (first) prompt."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return ("text", value) if value else None
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return ("ids", tuple(value))
    return None


def _messages(messages) -> PromptKey | None:
    if not isinstance(messages, list) or not messages:
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text parts, in order
            content = "".join(p.get("text", "") if isinstance(p, dict) else json.dumps(p) for p in content)
        elif not isinstance(content, str):
            content = json.dumps(content)
        parts.append(f"<{m.get('role')}>{content}\x1e")  # \x1e: a separator no message text is likely to hold
    return ("text", "".join(parts))
