"""--api-key on the router: clients need the key on every route but the probes, and the router sends it to the
workers (which `sgjax serve --dp-size N --api-key K` starts with the same key)."""

import httpx
from fastapi.testclient import TestClient

from sgjax.router.app import build_router_app
from sgjax.router.policy import make_policy
from sgjax.router.proxy import Router

A, B = "http://worker-a:1", "http://worker-b:2"


def test_router_requires_the_key_and_passes_it_on():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"max_total_tokens": 1000, "running_requests": 0, "waiting_requests": 0})
        if request.url.path in ("/health", "/flush_cache"):
            return httpx.Response(200, json={"success": True})
        return httpx.Response(200, json={"text": "ok", "meta_info": {}})

    router = Router(
        [A, B], make_policy("round_robin"), health_interval=0, transport=httpx.MockTransport(handler), api_key="k"
    )
    with TestClient(build_router_app(router)) as client:
        assert client.get("/health").status_code == 200  # a probe
        for method, path in (
            ("POST", "/generate"),
            ("GET", "/get_server_info"),
            ("POST", "/flush_cache"),
            ("POST", "/v1/completions"),
            ("POST", "/abort_request"),
        ):
            r = client.request(method, path, json={"text": "hi"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = client.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["text"] == "ok"
    assert seen and all(auth == "Bearer k" for _, auth in seen)
    assert any(path == "/generate" for path, _ in seen)
