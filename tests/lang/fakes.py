"""A scripted backend for the interpreter's unit tests: records every call, tokenizes by character and scores
a token by a table, so tests know exactly what the model side saw and in which order."""

from __future__ import annotations

import threading
import time

from sgjax.lang.backend.base import Backend
from sgjax.lang.chat_template import ChatTemplate

TEMPLATE = ChatTemplate(
    "test",
    {"system": ("<s>", "</s>"), "user": ("<u>", "</u>"), "assistant": ("<a>", "</a>")},
    default_system_prompt="DEFAULT",
    stop_str=("</a>",),
)


class FakeBackend(Backend):
    def __init__(self, reply=None, template=TEMPLATE, char_logprob=None, fail_on=None, pieces=None, gate=None):
        self.chat_template = template
        self.reply = reply or (lambda text, params: f"[{len(text)}]")
        self.char_logprob = char_logprob or (lambda context, ch: -1.0)
        self.fail_on = fail_on  # a string: a prompt containing it makes generate raise
        self.pieces = pieces  # streaming: the reply in these pieces
        self.gate = gate  # generate waits for this event
        self.started = threading.Event()
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def _record(self, *call):
        with self._lock:
            self.calls.append(call)

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def generate(self, text, params):
        self._record("generate", text, dict(params))
        self.started.set()
        if self.gate is not None:
            self.gate.wait()
        if self.fail_on is not None and self.fail_on in text:
            raise ValueError("the fake model refuses this prompt")
        return self.reply(text, params), {"prompt": text}

    def generate_stream(self, text, params):
        self._record("generate_stream", text, dict(params))
        for piece in self.pieces:
            time.sleep(0.02)
            yield piece, {}

    def cache_prefix(self, text, images=None):
        self._record("cache_prefix", text, *([images] if images else []))
        return {"cached": len(text)}

    def tokenize(self, text):
        return [ord(c) for c in text]

    def prompt_logprobs(self, input_ids, starts, images=None):
        self._record("prompt_logprobs", [list(ids) for ids in input_ids], list(starts), *([images] if images else []))
        return [
            [
                None if p == 0 else self.char_logprob("".join(map(chr, ids[:p])), chr(ids[p]))
                for p in range(start, len(ids))
            ]
            for ids, start in zip(input_ids, starts)
        ]
