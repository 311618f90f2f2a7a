"""The router's state and its forwarding: which workers are up, how loaded, and how a request reaches one.

A request is forwarded unchanged (body bytes, content type) and its answer comes back unchanged: a worker's 4xx keeps
its status and body, a stream is relayed event by event. A request naming a data-parallel rank r (sglang-router
--dp-aware's) goes to worker r, whatever the policy, without the rank field (keys.requested_rank). Worker failures:

- a transport error (refused connection, reset, a worker killed mid-answer) or a 503 (the worker is shutting down)
  marks the worker down, forgets its cache in the policy, and the request goes to another worker, as long as nothing
  of the answer has reached the client. A stream is held back until the worker's first complete event, so a worker
  that dies before answering is retried too; one that dies mid-stream ends the client's stream with an error event
  and `[DONE]` (the server's own in-band error shape): its tokens cannot be replayed elsewhere.
- no worker left: 503 naming each worker and why it is down.
- down workers are probed (GET /health) every `health_interval` seconds and come back with an empty picture.

No read timeout towards workers: a long generation on a CPU takes minutes, and a slow worker is not a dead one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx
from starlette.responses import Response, StreamingResponse

from sgjax.router.keys import prompt_key, requested_rank
from sgjax.router.policy import Policy, WorkerView, least_loaded
from sgjax.server.protocol import MAX_BODY_BYTES, ApiError

log = logging.getLogger("sgjax.router")

WORKER_HEADER = "x-sgjax-worker"  # which worker answered: for clients, tests and debugging
_PASS_HEADERS = ("content-type", "cache-control")


FROZEN_PROBES = 2  # /health probes in a row without an answer that eject a worker


@dataclass
class Worker:
    url: str
    pid: int | None = None  # when this router started the worker (`sgjax serve --dp-size`)
    healthy: bool = False  # until the first probe answers
    in_flight: int = 0
    dispatched: int = 0
    failures: int = 0
    last_error: str | None = None
    max_total_tokens: int | None = None
    probe_timeouts: int = 0  # /health probes in a row that got no answer
    down: asyncio.Event | None = None  # set when marked down: requests waiting on the worker give up and fail over

    def view(self) -> WorkerView:
        return WorkerView(self.url, self.in_flight, self.dispatched)


class Router:
    def __init__(
        self,
        urls: list[str],
        policy: Policy,
        *,
        pids: list[int] | None = None,
        health_interval: float = 5.0,
        probe_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        first_byte_timeout: float = 600.0,
    ):
        if not urls:
            raise ValueError("the router needs at least one worker URL")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"worker URLs must be distinct, got {urls}")
        self.workers = {u: Worker(u, pid=pids[i] if pids else None) for i, u in enumerate(urls)}
        self.policy = policy
        self.health_interval, self.probe_timeout = health_interval, probe_timeout
        # a request's first byte (the whole answer when not streamed) must come within this; else the worker is
        # marked down and the request, which has sent nothing to its client yet, goes to another one
        self.first_byte_timeout = first_byte_timeout
        self.failovers = 0
        # keepalive_expiry under uvicorn's 5 s keep-alive: an idle connection is dropped here before the worker
        # closes it, so a request never goes out on a connection the worker is closing.
        # --api-key: clients of the router must send it, and the router sends it to the workers (which then need
        # the same key: `serve --dp-size N --api-key K` gives it to them)
        self.api_key = api_key
        self.client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128, keepalive_expiry=2.0),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )
        self._health_task: asyncio.Task | None = None

    # -- life cycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.probe_all()
        up = [w.url for w in self.workers.values() if w.healthy]
        log.info("router (%s) over %d workers, %d up: %s", self.policy.name, len(self.workers), len(up), up)
        if self.health_interval > 0:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.workers.values()))

    async def probe(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.probe_timeout)
        except httpx.TimeoutException:
            # A worker answers /health on its event loop without waiting for the engine, however busy: two probes in
            # a row without an answer mean it stopped (frozen, swapped out), not that it is busy.
            w.probe_timeouts += 1
            if w.probe_timeouts >= FROZEN_PROBES:
                return self.mark_down(w, f"/health unanswered {w.probe_timeouts} times in a row (frozen?)")
            log.warning("worker %s: /health timed out (%d in a row)", w.url, w.probe_timeouts)
            return
        except httpx.TransportError as e:
            return self.mark_down(w, e)
        w.probe_timeouts = 0
        if r.status_code != 200:
            return self.mark_down(w, f"/health answered {r.status_code}")
        if not w.healthy or w.max_total_tokens is None:
            await self._read_capacity(w)

    async def _read_capacity(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/get_server_info", timeout=60.0)
            r.raise_for_status()
            info = r.json()
        except (httpx.HTTPError, ValueError) as e:
            return self.mark_down(w, e)
        w.max_total_tokens = info.get("max_total_tokens")
        if w.max_total_tokens:
            self.policy.set_capacity(w.url, w.max_total_tokens)
        if not w.healthy:
            log.info("worker %s up (pool %s tokens)", w.url, w.max_total_tokens)
        w.healthy, w.last_error = True, None

    def mark_down(self, w: Worker, error) -> None:
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
        if w.healthy:
            log.warning("worker %s down: %s", w.url, msg)
        w.healthy, w.last_error = False, msg
        w.failures += 1
        if w.down is not None:
            w.down.set()
            w.down = None  # a new one for the next time it is up
        self.policy.forget(w.url)  # down or restarted: its cache is gone either way

    # -- choosing --------------------------------------------------------------------------------------------
    async def pick(self, key, tried: dict[str, str], use_policy: bool = True) -> Worker:
        """The policy's worker among the healthy ones not tried yet; without the policy (read-only routes, which
        must not move a round-robin turn or count as decisions), the least loaded."""
        candidates = [w for w in self.workers.values() if w.healthy and w.url not in tried]
        if not candidates and not tried:
            await self.probe_all()  # all marked down: one may be back before the next health round
            candidates = [w for w in self.workers.values() if w.healthy]
        if not candidates:
            raise ApiError(self.none_left(tried), status=503, kind="unavailable")
        views = [w.view() for w in candidates]
        url = self.policy.select(views, key).url if use_policy else least_loaded(views).url
        return self.workers[url]

    def none_left(self, tried: dict[str, str]) -> str:
        why = {w.url: w.last_error or "down" for w in self.workers.values()}
        why.update(tried)
        return "no healthy worker: " + "; ".join(f"{u} ({e})" for u, e in why.items())

    def _dispatch(self, w: Worker, key) -> None:
        w.in_flight += 1
        w.dispatched += 1
        self.policy.on_dispatch(w.url, key)

    # -- forwarding ------------------------------------------------------------------------------------------
    async def forward(self, path: str, body: bytes, content_type: str | None) -> Response:
        """A generation request: to the policy's worker, again elsewhere while nothing was sent to the client."""
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(f"body: larger than {MAX_BODY_BYTES} bytes", status=413)
        key = prompt_key(path, body)
        rank, body = requested_rank(body, len(self.workers))
        headers = {"content-type": content_type or "application/json"}
        if rank is not None:
            return await self._forward_to_rank(rank, path, body, headers, key)
        tried: dict[str, str] = {}
        while True:
            w = await self.pick(key, tried)
            self._dispatch(w, key)
            answer = await self._try(w, path, body, headers, key)
            if isinstance(answer, Response):
                return answer
            tried[w.url] = answer  # the error: the worker is marked down; next one
            self.failovers += 1
            log.warning("request to %s failed (%s); trying another worker", w.url, answer)

    async def _forward_to_rank(self, rank: int, path: str, body: bytes, headers: dict, key) -> Response:
        """A request that names its data-parallel rank (sglang-router --dp-aware names one in every request): to
        worker `rank` whatever the policy would pick, which still records it. That worker down is a 503, never another
        worker: the client's router chose this one, and retries elsewhere itself."""
        w = list(self.workers.values())[rank]
        if not w.healthy:
            await self.probe(w)  # it may be back before the next health round
        if w.healthy:
            self._dispatch(w, key)
            answer = await self._try(w, path, body, headers, key)
            if isinstance(answer, Response):
                return answer
        raise ApiError(
            f"rank {rank}: worker {w.url} is down ({w.last_error or 'down'})", status=503, kind="unavailable"
        )

    async def _try(self, w: Worker, path: str, body: bytes, headers: dict, key) -> Response | str:
        """The worker's answer, or the reason it has none (the worker is then marked down): bounded by the
        first-byte timeout, and given up as soon as the worker is marked down meanwhile (a frozen worker's
        requests fail over instead of hanging)."""
        if w.down is None:
            w.down = asyncio.Event()
        attempt = asyncio.ensure_future(self._attempt(w, path, body, headers, key))
        down = asyncio.ensure_future(w.down.wait())
        done, _ = await asyncio.wait(
            {attempt, down}, timeout=self.first_byte_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        down.cancel()
        if attempt in done:
            return attempt.result()
        attempt.cancel()  # closes the connection to the worker (its server aborts the request)
        await asyncio.gather(attempt, return_exceptions=True)
        if not done:
            self.mark_down(w, f"no answer within {self.first_byte_timeout:g} s")
        return w.last_error

    async def _attempt(self, w: Worker, path: str, body: bytes, headers: dict, key) -> Response | str:
        relay = None
        try:
            resp = await self.client.send(
                self.client.build_request("POST", w.url + path, content=body, headers=headers), stream=True
            )
            try:
                if resp.status_code == 503:  # shutting down: not this request's fault
                    msg = _error_message(await resp.aread()) or "503"
                    self.mark_down(w, f"503: {msg}")
                    return f"503: {msg}"
                if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                    events = _sse_events(resp)
                    first = await anext(events)  # nothing reached the client yet: a failure here fails over
                    relay = Relay(self, w, resp, events, first)
                    return relay.response()
                content = await resp.aread()
            finally:
                if relay is None:
                    await resp.aclose()
        except (httpx.TransportError, StopAsyncIteration) as e:
            error = e if isinstance(e, httpx.TransportError) else "stream ended before its first event"
            self.mark_down(w, error)
            return w.last_error
        finally:
            if relay is None:
                w.in_flight -= 1
        self._learn(key, resp.status_code, content)
        return Response(content, status_code=resp.status_code, headers=_headers(resp, w))

    def _learn(self, key, status: int, content: bytes) -> None:
        """A single text prompt's answer carries its token count: refines the meta-tree's characters per token."""
        if status != 200 or not key or key[0] != "text" or len(content) > 1 << 20:
            return
        try:
            result = json.loads(content)
            meta = (result[0] if isinstance(result, list) else result).get("meta_info") or {}
            tokens = meta.get("prompt_tokens") or (result.get("usage") or {}).get("prompt_tokens")
        except (ValueError, AttributeError, IndexError, TypeError):
            return
        if isinstance(tokens, int):
            self.policy.observe(len(key[1]), tokens)

    async def get_any(self, path: str) -> Response:
        """A read-only route any worker answers the same (/v1/models, /get_model_info, /health_generate)."""
        tried: dict[str, str] = {}
        while True:
            w = await self.pick(None, tried, use_policy=False)
            try:
                r = await self.client.get(w.url + path)
            except httpx.TransportError as e:
                self.mark_down(w, e)
                tried[w.url] = w.last_error
                continue
            return Response(r.content, status_code=r.status_code, headers=_headers(r, w))

    async def broadcast(
        self, method: str, path: str, body: bytes = b"", content_type: str | None = None
    ) -> dict[str, httpx.Response | str]:
        """The same request to every healthy worker: url -> its response, or the transport error's message."""
        up = [w for w in self.workers.values() if w.healthy]
        headers = {"content-type": content_type} if content_type else {}

        async def one(w: Worker):
            try:
                return await self.client.request(method, w.url + path, content=body, headers=headers, timeout=60.0)
            except httpx.TransportError as e:
                self.mark_down(w, e)
                return w.last_error

        return dict(zip([w.url for w in up], await asyncio.gather(*(one(w) for w in up))))

    def router_info(self) -> dict:
        return {
            "policy": self.policy.name,
            "failovers": self.failovers,
            "dispatch_counts": {w.url: w.dispatched for w in self.workers.values()},
            "workers": [
                {
                    "url": w.url,
                    "healthy": w.healthy,
                    "in_flight": w.in_flight,
                    "dispatched": w.dispatched,
                    "failures": w.failures,
                    "last_error": w.last_error,
                    "max_total_tokens": w.max_total_tokens,
                    "pid": w.pid,
                }
                for w in self.workers.values()
            ],
            **self.policy.stats(),
        }


class Relay:
    """A worker's SSE stream relayed to the client event by event. The response's own `__call__` closes the
    worker's stream however the client's response ends (finished, client gone, cancelled), so the in-flight count
    and the worker connection are released exactly once, and a client that leaves aborts the worker's request."""

    def __init__(self, router: Router, w: Worker, resp: httpx.Response, events, first: bytes):
        self.router, self.w, self.resp, self.events, self.first = router, w, resp, events, first
        self._closed = False

    def response(self) -> StreamingResponse:
        relay = self

        class _Response(StreamingResponse):
            async def __call__(self, scope, receive, send):
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    await relay.close()

        return _Response(self._body(), status_code=200, headers=_headers(self.resp, self.w))

    async def _body(self):
        yield self.first
        try:
            async for event in self.events:
                yield event
        except httpx.TransportError as e:
            self.router.mark_down(self.w, e)
            err = ApiError(
                f"worker {self.w.url} failed mid-stream ({self.w.last_error}); the request was not "
                f"retried because part of its answer was already sent",
                status=502,
                kind="server_error",
                code="worker_failed",
            )
            yield f"data: {json.dumps(err.body())}\n\n".encode() + b"data: [DONE]\n\n"

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.w.in_flight -= 1
            await self.events.aclose()
            await self.resp.aclose()


async def _sse_events(resp: httpx.Response):
    """Complete SSE events (each ending in a blank line) from a worker's byte stream: the client never receives a
    half event, so an error event after a failure is always well formed."""
    buf = b""
    async for chunk in resp.aiter_raw():
        buf += chunk
        end = buf.rfind(b"\n\n")
        if end >= 0:
            yield buf[: end + 2]
            buf = buf[end + 2 :]
    if buf.strip():
        yield buf


def _headers(resp: httpx.Response, w: Worker) -> dict:
    out = {k: resp.headers[k] for k in _PASS_HEADERS if k in resp.headers}
    out[WORKER_HEADER] = w.url
    return out


def _error_message(content: bytes) -> str | None:
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return content.decode("utf-8", "replace")[:200] or None
