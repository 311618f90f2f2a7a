"""How a caller waits for its requests: each API form (a blocking call, a stream, an asyncio future or stream) sets a
request's sink, which the engine thread calls with (req, new_text, finished), and hands the request to the loop.
Sinks only take O(1) snapshots on the engine thread; callers build result dicts on their own threads."""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from sgjax.engine.outputs import result, snapshot
from sgjax.engine.request import Req


@dataclass(frozen=True)
class Queue:
    """The engine's side a caller needs: add a request to the loop, abort one by id."""

    add: Callable[[Req], None]
    abort: Callable[[str], None]


def submit(q: Queue, req: Req):
    """Queue the request; returns a function that waits for its result (generate's batch form waits on all)."""
    done = threading.Event()
    box = {}

    def sink(req, new_text, finished):
        if finished:
            box["result"] = result(req)
            done.set()

    req.sink = sink
    q.add(req)

    def wait():
        done.wait()
        return box["result"]

    return wait


def stream(q: Queue, req: Req):
    """Result dicts as the request's text grows; leaving the iterator early aborts it."""
    chunks: queue.Queue = queue.Queue()
    # The loop thread only takes a snapshot (O(1)); the caller's thread copies the lists (O(n) per chunk).
    req.sink = lambda r, new_text, finished: chunks.put(snapshot(r))
    q.add(req)
    try:
        while True:
            item = result(req, chunks.get())
            yield item
            if item["meta_info"]["finish_reason"] is not None:
                return
    finally:
        if not req.finished:
            q.abort(req.rid)


def async_one(q: Queue, req: Req):
    """Queues the request now (so that the engine's queued count sees it at once, --max-queued-requests) and returns
    the awaitable result; a cancelled await aborts the request."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def sink(r, new_text, finished):
        if finished:
            res = result(r)
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(res))

    req.sink = sink
    q.add(req)
    return _awaited(q, req, fut)


async def _awaited(q: Queue, req: Req, fut):
    try:
        return await fut
    except asyncio.CancelledError:
        q.abort(req.rid)
        raise


async def async_stream(q: Queue, req: Req):
    """Result dicts as the text grows, for asyncio; leaving early aborts the request."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue = asyncio.Queue()
    req.sink = lambda r, new_text, finished: loop.call_soon_threadsafe(chunks.put_nowait, snapshot(r))
    q.add(req)
    try:
        while True:
            item = result(req, await chunks.get())
            yield item
            if item["meta_info"]["finish_reason"] is not None:
                return
    finally:
        if not req.finished:
            q.abort(req.rid)
