"""A worker that stops answering (frozen, e.g. SIGSTOP: its port still accepts connections) behind the router:
/health probes that time out twice in a row eject it, requests waiting on it fail over to another worker before
anything reached their client, and a request is never left hanging."""

import asyncio

import httpx
from fastapi.testclient import TestClient

from sgjax.router.app import build_router_app
from sgjax.router.policy import make_policy
from sgjax.router.proxy import FROZEN_PROBES, Router

A, B = "http://worker-a:1", "http://worker-b:2"


def fleet(frozen: set):
    seen = []

    async def handler(request: httpx.Request) -> httpx.Response:
        worker = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        seen.append((worker, request.url.path))
        if worker in frozen:
            if request.url.path == "/health":  # what the real transport raises once the probe's timeout passes
                raise httpx.ReadTimeout("timed out", request=request)
            await asyncio.sleep(3600)  # accepted, never answered (MockTransport applies no timeout)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"max_total_tokens": 1000, "running_requests": 0, "waiting_requests": 0})
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"text": f"from {worker}", "meta_info": {}})

    return handler, seen


def test_requests_to_a_frozen_worker_fail_over():
    frozen = set()
    handler, seen = fleet(frozen)
    router = Router(
        [A, B],
        make_policy("round_robin"),
        health_interval=0,
        probe_timeout=0.2,
        transport=httpx.MockTransport(handler),
        first_byte_timeout=1.0,
    )
    with TestClient(build_router_app(router)) as client:
        assert router.workers[A].healthy and router.workers[B].healthy
        frozen.add(A)
        answers = [client.post("/generate", json={"text": f"q{i}"}).json()["text"] for i in range(4)]
        assert answers == [f"from {B}"] * 4  # the one sent to A waited at most 1 s, then went to B
        assert not router.workers[A].healthy and "no answer within 1 s" in router.workers[A].last_error
        assert router.workers[A].in_flight == 0 and router.failovers == 1
        assert any(w == A and p == "/generate" for w, p in seen)


def test_health_probes_eject_a_frozen_worker_and_take_it_back():
    frozen = set()
    handler, _ = fleet(frozen)
    router = Router(
        [A, B], make_policy("round_robin"), health_interval=0, probe_timeout=0.2, transport=httpx.MockTransport(handler)
    )
    with TestClient(build_router_app(router)) as client:
        frozen.add(A)
        for i in range(FROZEN_PROBES):
            assert router.workers[A].healthy, f"ejected after {i} probe(s)"
            client.portal.call(router.probe_all)
        assert not router.workers[A].healthy and "frozen" in router.workers[A].last_error
        assert client.get("/health").status_code == 200  # B still serves
        frozen.clear()
        client.portal.call(router.probe_all)
        assert router.workers[A].healthy and router.workers[A].probe_timeouts == 0
