"""The router app in process over scripted workers (an httpx MockTransport): pass-through of answers and errors,
fail-over before anything reached the client, a clear error after, 503 with no worker left, broadcasts, aggregated
info, in-flight accounting. The real workers are in test_e2e.py."""

import json

import httpx
import pytest
from starlette.testclient import TestClient

from sgjax.router.app import build_router_app
from sgjax.router.policy import make_policy
from sgjax.router.proxy import WORKER_HEADER, Router

A, B = "http://worker-a:1", "http://worker-b:2"


class FakeWorker:
    """A scripted `sgjax serve`: /generate answers its own name; modes make it fail in chosen ways."""

    def __init__(self, url):
        self.url, self.name = url, url.split("//")[1].split(":")[0]
        self.mode = "ok"  # ok | down | shutting_down | die_before_first_event | die_mid_stream | busy
        self.prompt_tokens = self.cached_tokens = 0
        self.flushes = 0
        self.requests = []
        self.tp_size = 2

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/get_server_info":
            return httpx.Response(
                200,
                json={
                    "max_total_tokens": 1000,
                    "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens,
                    "running_requests": 0,
                    "waiting_requests": 0,
                    "name": self.name,
                    "tp_size": self.tp_size,
                    "nnodes": 1,
                    "mesh_shape": {"data": 1, "tensor": self.tp_size},
                },
            )
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        if path == "/flush_cache":
            if self.mode == "busy":
                return httpx.Response(
                    400, json={"error": {"message": "flush_cache: refused while requests are running", "code": 400}}
                )
            self.flushes += 1
            return httpx.Response(200, json={"success": True})
        if self.mode == "shutting_down":
            return httpx.Response(503, json={"error": {"message": "engine shut down", "code": 503}})
        body = json.loads(request.content)
        self.requests.append(body)
        if (body.get("sampling_params") or {}).get("temperature", 0) < 0:
            return httpx.Response(
                400,
                json={
                    "error": {
                        "message": "sampling_params.temperature: must be >= 0, got -1",
                        "param": "sampling_params.temperature",
                        "type": "invalid_request_error",
                        "code": 400,
                    }
                },
            )
        tokens = len(body.get("text", "")) // 2
        self.prompt_tokens += tokens
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=self._events())
        return httpx.Response(200, json={"text": f"from {self.name}", "meta_info": {"prompt_tokens": tokens}})

    def _events(self):
        worker = self

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self):
                if worker.mode == "die_before_first_event":
                    raise httpx.ReadError("connection reset")
                for i in range(3):
                    # an event split across chunks: the router only forwards whole events
                    yield f'data: {{"text": "{worker.name} {i}"'.encode()
                    yield b"}\n\n"
                    if worker.mode == "die_mid_stream":
                        raise httpx.RemoteProtocolError("peer closed connection")
                yield b"data: [DONE]\n\n"

        return Stream()


@pytest.fixture
def fleet():
    workers = {A: FakeWorker(A), B: FakeWorker(B)}

    async def handler(request):
        return await workers[f"{request.url.scheme}://{request.url.host}:{request.url.port}"].handle(request)

    def make(policy="round_robin"):
        router = Router([A, B], make_policy(policy), health_interval=0, transport=httpx.MockTransport(handler))
        return TestClient(build_router_app(router)), router

    return workers, make


def events(response) -> list:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def test_answers_and_worker_errors_pass_through(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        r = client.post("/generate", json={"text": "hello"})
        assert r.status_code == 200 and r.json()["text"] == "from worker-a" and r.headers[WORKER_HEADER] == A
        r = client.post("/generate", json={"text": "hello"})
        assert r.json()["text"] == "from worker-b"
        direct = {
            "error": {
                "message": "sampling_params.temperature: must be >= 0, got -1",
                "param": "sampling_params.temperature",
                "type": "invalid_request_error",
                "code": 400,
            }
        }
        r = client.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
        assert r.status_code == 400 and r.json() == direct
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        assert all(w.in_flight == 0 for w in router.workers.values())


def test_a_down_worker_is_skipped_and_marked(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].mode = "down"
        for _ in range(3):
            r = client.post("/generate", json={"text": "hello"})
            assert r.status_code == 200 and r.json()["text"] == "from worker-b"
        info = client.get("/get_server_info").json()
        a = info["router"]["workers"][0]
        assert not a["healthy"] and "ConnectError: connection refused" in a["last_error"]
        assert info["router"]["failovers"] == 1 and info["healthy_workers"] == 1  # marked once, then skipped
        assert "error" in info["workers"][0] and info["workers"][1]["info"]["name"] == "worker-b"
        workers[A].mode = "ok"
        assert client.get("/health").status_code == 200  # probes: A is back
        assert router.workers[A].healthy


def test_a_shutting_down_worker_fails_over(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].mode = "shutting_down"
        r = client.post("/generate", json={"text": "hello"})
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == B
        assert router.workers[A].last_error == "503: engine shut down"


def test_no_worker_left_is_a_503_naming_each(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].mode = workers[B].mode = "down"
        r = client.post("/generate", json={"text": "hello"})
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert msg.startswith("no healthy worker: ") and A in msg and B in msg and "connection refused" in msg
        assert client.get("/health").status_code == 503
        workers[B].mode = "ok"
        r = client.post("/generate", json={"text": "hello"})  # nobody healthy: the router probes again first
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == B


def test_streams_pass_through_whole_events(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        with client.stream("POST", "/generate", json={"text": "hi", "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream") and r.headers[WORKER_HEADER] == A
            chunks = [c for c in r.iter_raw()]
        body = b"".join(chunks).decode()
        assert events(type("R", (), {"text": body})) == [
            '{"text": "worker-a 0"}',
            '{"text": "worker-a 1"}',
            '{"text": "worker-a 2"}',
            "[DONE]",
        ]
        assert all(c.endswith(b"\n\n") for c in chunks)  # never half an event
        assert router.workers[A].in_flight == 0


def test_a_stream_that_fails_before_its_first_event_goes_elsewhere(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].mode = "die_before_first_event"
        r = client.post("/generate", json={"text": "hi", "stream": True})
        assert r.status_code == 200 and r.headers[WORKER_HEADER] == B
        assert events(r)[0] == '{"text": "worker-b 0"}' and events(r)[-1] == "[DONE]"
        assert not router.workers[A].healthy and router.failovers == 1
        assert router.workers[A].in_flight == router.workers[B].in_flight == 0


def test_a_stream_that_fails_midway_ends_with_a_clear_error(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].mode = "die_mid_stream"
        r = client.post("/generate", json={"text": "hi", "stream": True})
        got = events(r)
        assert got[0] == '{"text": "worker-a 0"}' and got[-1] == "[DONE]" and len(got) == 3
        err = json.loads(got[1])["error"]
        assert err["code"] == "worker_failed" and f"worker {A} failed mid-stream" in err["message"]
        assert "not retried" in err["message"]
        assert not router.workers[A].healthy and router.workers[A].in_flight == 0
        assert len(workers[B].requests) == 0  # a started stream is not replayed


def test_flush_cache_broadcasts_and_clears_the_meta_tree(fleet):
    workers, make = fleet
    client, router = make("cache_aware")
    with client:
        client.post("/generate", json={"text": "a long shared prefix " * 5})
        assert router.policy.tree.num_nodes() > 0
        r = client.post("/flush_cache")
        assert r.status_code == 200 and r.json()["success"]
        assert workers[A].flushes == workers[B].flushes == 1 and router.policy.tree.num_nodes() == 0

        client.post("/generate", json={"text": "on a " * 20})
        client.post("/generate", json={"text": "on b, different " * 5})
        assert sorted(router.policy.tree.workers()) == [A, B]
        workers[B].mode = "busy"
        r = client.post("/flush_cache")
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert msg.startswith("flush_cache: refused by 1 of 2 workers") and B in msg and "refused while" in msg
        assert router.policy.tree.workers() == [B]  # A was flushed: its picture is gone; B's stays


def test_server_info_adds_up_the_workers(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        workers[A].prompt_tokens, workers[A].cached_tokens = 100, 60
        workers[B].prompt_tokens, workers[B].cached_tokens = 300, 40
        info = client.get("/get_server_info").json()
        assert info["prompt_tokens"] == 400 and info["cached_tokens"] == 100 and info["cache_hit_rate"] == 0.25
        assert info["max_total_tokens"] == 2000 and info["num_workers"] == 2
        assert (info["dp_size"], info["tp_size"], info["nnodes"], info["mesh_shape"]) == (
            2,
            2,
            1,
            {"data": 1, "tensor": 2},
        )
        workers[B].tp_size = 4  # unlike workers: no one layout to report
        info = client.get("/get_server_info").json()
        assert (info["dp_size"], info["tp_size"], info["nnodes"], info["mesh_shape"]) == (2, None, 1, None)
        client.post("/generate", json={"text": "x"})
        info = client.get("/get_server_info").json()
        assert info["router"]["dispatch_counts"] == {A: 1, B: 0} and info["router"]["policy"] == "round_robin"


def test_cache_aware_keeps_a_prefix_on_one_worker_and_learns_token_sizes(fleet):
    workers, make = fleet
    client, router = make("cache_aware")
    with client:
        prefix = "The following are questions with answers. " * 10
        served = [client.post("/generate", json={"text": prefix + f"Q{i}?"}).headers[WORKER_HEADER] for i in range(4)]
        other = client.post("/generate", json={"text": "another few-shot prefix entirely " * 10})
        assert len(set(served)) == 1 and other.headers[WORKER_HEADER] != served[0]
        assert router.policy.tree.capacity == {A: 1000, B: 1000}  # from each worker's server info
        assert router.policy.tree.chars_per_token == pytest.approx(2.0, rel=0.01)  # the fake: 2 characters a token
        assert router.policy.decisions["cache"] == 3


def test_oversized_body_is_413(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        r = client.post("/generate", content=b"x" * ((32 << 20) + 1), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "body: larger than" in r.json()["error"]["message"]
        assert client.get("/nope").status_code == 404
        assert workers[A].requests == workers[B].requests == []


def test_read_only_routes_do_not_move_the_policy(fleet):
    workers, make = fleet
    client, router = make()
    with client:
        assert client.post("/generate", json={"text": "1"}).headers[WORKER_HEADER] == A
        for route in ("/v1/models", "/get_model_info", "/get_server_info", "/health"):
            client.get(route)
        assert client.post("/generate", json={"text": "2"}).headers[WORKER_HEADER] == B  # still B's turn
        assert router.workers[A].dispatched == router.workers[B].dispatched == 1


def test_a_request_naming_its_rank_goes_to_that_worker_without_the_field(fleet):
    """sglang-router --dp-aware names a rank in every request: worker r serves rank r, whatever the policy."""
    workers, make = fleet
    client, router = make("cache_aware")  # alone, it would keep the one prompt on one worker
    with client:
        served = []
        for rank in (1, 1, 0, 1):
            r = client.post("/generate", json={"text": "the same prompt " * 8, "data_parallel_rank": rank})
            assert r.status_code == 200, r.text
            served.append(r.headers[WORKER_HEADER])
        assert served == [B, B, A, B]
        chat = {"messages": [{"role": "user", "content": "hi"}], "routed_dp_rank": 0, "data_parallel_rank": 1}
        assert client.post("/v1/chat/completions", json=chat).headers[WORKER_HEADER] == A  # SGLang's name wins
        assert client.post("/generate", json={"text": "x", "data_parallel_rank": None}).status_code == 200
        sent = workers[A].requests + workers[B].requests
        assert len(sent) == 6 and not any("routed_dp_rank" in b for b in sent)
        assert sum("data_parallel_rank" in b for b in sent) == 1  # the null one: no rank, passed on unchanged
        for bad in (2, -1, "1", 1.0, True, [1]):
            r = client.post("/generate", json={"text": "x", "data_parallel_rank": bad})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "data_parallel_rank", r.text
            assert err["message"].startswith("data_parallel_rank: out of range [0, 2): "), err
        assert len(workers[A].requests + workers[B].requests) == 6  # refused by the router itself
        workers[B].mode = "down"
        r = client.post("/generate", json={"text": "x", "data_parallel_rank": 1})
        assert r.status_code == 503 and f"rank 1: worker {B} is down" in r.json()["error"]["message"], r.text
        assert len(workers[A].requests) == 2  # not sent elsewhere: the client's router chose that rank
