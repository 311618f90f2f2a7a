"""A chat answer's text -> OpenAI's assistant message (content, reasoning_content, tool_calls) and, for streams, the
same as deltas: the reasoning parser splits first, the tool-call parser reads the content part."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sgjax.server.reasoning import ReasoningParser, ReasoningStream
from sgjax.server.tool_parsers import Stream, final_content
from sgjax.server.tools import call_id


@dataclass(frozen=True)
class ChatOutput:
    tools: object | None = None  # a tool_parsers format; None: no tool calls are parsed
    reasoning: ReasoningParser | None = None
    stream_reasoning: bool = True  # False: a stream sends the reasoning whole when it ends (SGLang's field)

    @property
    def plain(self) -> bool:
        return self.tools is None and self.reasoning is None

    def message(self, text: str) -> tuple[dict, bool]:
        """(the message, whether it calls tools)."""
        msg: dict = {"role": "assistant"}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            msg["reasoning_content"] = reasoning or None
        if self.tools is None:
            return {**msg, "content": text}, False
        scan = self.tools.scan(text)
        calls = [c for c in scan.calls if _whole(c.arguments)]
        if len(calls) < len(scan.calls):  # cut off by max_tokens mid-call: the text as it is, never a made-up call
            return {**msg, "content": text}, False
        if not calls:  # stripped as a stream's deltas are (they cannot know whether a call follows)
            return {**msg, "content": final_content(scan.content)}, False
        msg["content"] = final_content(scan.content) or None
        msg["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in scan.calls
        ]
        return msg, True

    def stream(self) -> "ChatStream":
        return ChatStream(self)


def _whole(arguments: str) -> bool:
    """Whether a call's arguments are a whole JSON value (a budget too small for any complete call leaves a cut one:
    fsm/completion.py)."""
    try:
        json.loads(arguments)
        return True
    except ValueError:
        return False


class ChatStream:
    """`feed(cumulative text, final)` -> the delta dicts to send (possibly none), OpenAI's streaming shapes: a call's
    first delta has its index, id, type and name with the arguments so far; later ones, its index and more
    arguments."""

    def __init__(self, out: ChatOutput):
        self.reasoning = (
            ReasoningStream(out.reasoning, whole=not out.stream_reasoning) if out.reasoning is not None else None
        )
        self.tools = Stream(out.tools) if out.tools is not None else None
        self.seen = 0
        self.called = False

    def feed(self, text: str, final: bool = False) -> list[dict]:
        delta, self.seen = text[self.seen :], len(text)
        out = []
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta, final)
            if thought:
                out.append({"reasoning_content": thought})
        if self.tools is None:
            if delta:
                out.append({"content": delta})
            return out
        content, calls = self.tools.feed(delta, final)
        if content:
            out.append({"content": content})
        for c in calls:
            self.called = True
            if c.name is not None:
                piece = {
                    "index": c.index,
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
            else:
                piece = {"index": c.index, "function": {"arguments": c.arguments}}
            out.append({"tool_calls": [piece]})
        return out
