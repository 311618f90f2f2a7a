"""The engine thread's inbox: the messages callers' threads send the loop, and the drain of a fatal stop."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable

from sgjax.engine.request import Req
from sgjax.errors import INTERNAL, EngineError


@dataclass(frozen=True)
class Add:
    req: Req


@dataclass(frozen=True)
class Abort:
    rid: str | None  # None: every request


@dataclass(frozen=True)
class Call:
    """Run `fn` between steps; the caller waits on `done` for `box` ("result" or "error")."""

    fn: Callable
    done: threading.Event
    box: dict


@dataclass(frozen=True)
class Stop:
    pass


def drain_failing(inbox: queue.Queue, message: str) -> list[Req]:
    """Empty the inbox without the loop (it may be stuck in a collective with a lost host): every waiting Call gets
    `message` as its error; the requests that were on their way in are returned, for the caller to fail."""
    reqs = []
    while True:
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            return reqs
        if isinstance(msg, Add):
            reqs.append(msg.req)
        elif isinstance(msg, Call):
            msg.box["error"] = EngineError(message, INTERNAL)
            msg.done.set()
