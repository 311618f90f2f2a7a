"""A time budget for compiling one grammar: the compile loops call `check()`, which raises GrammarError once the
thread's deadline has passed. A 60-byte regex (`[\\u0000-\\U0010FFFF]{1000}`) once took minutes to compile and held a
worker the whole time; with the budget it is a 400 after `seconds`."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from sgjax.fsm.errors import GrammarError

_local = threading.local()


@contextmanager
def deadline(seconds: float | None):
    previous = getattr(_local, "deadline", None)
    _local.deadline = None if seconds is None else (time.monotonic() + seconds, seconds)
    try:
        yield
    finally:
        _local.deadline = previous


def check() -> None:
    d = getattr(_local, "deadline", None)
    if d is not None and time.monotonic() > d[0]:
        raise GrammarError(
            f"the grammar takes longer than {d[1]:g} s to compile (simplify it: large repetitions "
            f"of wide character classes are the usual cause)"
        )
