"""The meta-tree key of a request body: ("text", characters) or ("ids", token ids), or None.

The router never validates bodies (the worker does, and answers a 400 naming the field, which passes through): a
body it cannot read has no key and goes to the least-loaded worker. A batch goes to one worker (its answer is one
response), keyed by its first prompt. Chat messages become one string, each message serialised on its own and
concatenated, so a conversation's next turn extends the previous turn's key exactly as its prompt extends the
previous prompt.
"""

from __future__ import annotations

import json

from sgjax.router.policy import PromptKey


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
