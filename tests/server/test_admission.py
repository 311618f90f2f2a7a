"""--max-queued-requests counts a generation from its admission, not from when its engine call first runs (a loop
turn later, in wait_for's task): a burst of handlers admitted in one turn cannot all pass the cap."""

import types

import pytest

from sgjax.server.protocol import ApiError
from sgjax.server.serving import Serving


def serving(cap: int, engine_queued: int = 0) -> Serving:
    s = Serving.__new__(Serving)  # only what _admit reads
    s.http = types.SimpleNamespace(max_queued_requests=cap)
    s.engine = types.SimpleNamespace(queued_requests=lambda: engine_queued)
    s._admitted = 0
    return s


def test_admitted_calls_count_until_released_once():
    s = serving(cap=2)
    first, second = s._admit(None), s._admit(None)
    with pytest.raises(ApiError) as e:  # two admitted, neither started: the third is refused
        s._admit(None)
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    first()
    first()  # idempotent: a second release must not free another place
    s._admit(None)
    with pytest.raises(ApiError):
        s._admit(None)
    second()
    assert s._admitted == 1


def test_engine_queue_and_admitted_add_up():
    s = serving(cap=3, engine_queued=2)
    s._admit(None)
    with pytest.raises(ApiError):
        s._admit(None)
    assert serving(cap=None, engine_queued=10**6)._admit(None) is not None  # no cap: always admitted
