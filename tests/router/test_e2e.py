"""The router with real processes: `sgjax serve --dp-size 2` (two SmolLM2 workers behind a cache_aware router) and
a round_robin `sgjax router` in front of the same workers, and SGLang's own Rust router (sglang-router) too.

The tests run in file order and the last two change the fleet: one kills a worker, the last stops the launcher."""

import argparse
import os
import signal
import time

import httpx
import openai
import pytest

from sgjax.router.launch import sglang_router_command
from sgjax.router.proxy import WORKER_HEADER
from sgjax.server.process import ServerProcess, free_port
from tests.server.conftest import sse_events, wait_idle

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


def few_shot(group: str, question: int) -> str:
    """Two few-shot groups with distinct long prefixes (~350 tokens) and a short question each."""
    if group == "A":
        prefix = "Astronomy notes. " + ". ".join(f"Fact {i}: star {i} is {i * 7} light years away" for i in range(25))
    else:
        prefix = "Kitchen diary. " + ". ".join(
            f"Recipe {i}: bake loaf {i} for {i * 3} minutes at {150 + i} degrees" for i in range(22)
        )
    return f"{prefix}.\nQuestion {question}: what does entry {question} say?\nAnswer:"


def generate(client: httpx.Client, text: str, **params) -> httpx.Response:
    r = client.post("/generate", json={"text": text, "sampling_params": {**GREEDY, **params}})
    assert r.status_code == 200, r.text
    return r


def test_generate_through_the_router_equals_a_workers_own_answer(ca, workers):
    prompt = "The three primary colors are"
    r = generate(ca, prompt)
    served = r.headers[WORKER_HEADER]
    assert served in [w["url"] for w in workers]
    for w in workers:  # the worker that served it, and the other one
        direct = httpx.post(
            w["url"] + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=300
        ).json()
        assert direct["text"] == r.json()["text"] and direct["output_ids"] == r.json()["output_ids"]
        assert direct["meta_info"]["prompt_tokens"] == r.json()["meta_info"]["prompt_tokens"]
    ids = r.json()["output_ids"]
    assert len(ids) > 1 and r.json()["text"].strip()
    batch = ca.post("/generate", json={"text": [prompt, "Water boils at"], "sampling_params": GREEDY}).json()
    assert batch[0]["text"] == r.json()["text"] and len(batch) == 2


def test_streams_pass_through(ca, launcher):
    prompt = "Once upon a time"
    whole = generate(ca, prompt).json()["text"]
    with ca.stream("POST", "/generate", json={"text": prompt, "stream": True, "sampling_params": GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = sse_events(r.iter_lines())
    assert got[-1] == "[DONE]" and len(got) > 3  # one event per token, passed on as they come
    texts = [e["text"] for e in got[:-1]]
    assert texts[-1] == whole and all(b.startswith(a) for a, b in zip(texts, texts[1:]))

    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="-")
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    pieces = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == full.choices[0].message.content


def test_a_workers_400_passes_through_unchanged(ca, workers):
    for body in (
        {"text": "hi", "sampling_params": {"temperature": -1}},
        {"text": "hi", "sampling_params": {"nucleus": 0.5}},
        {"input_ids": "not ids"},
    ):
        via = ca.post("/generate", json=body)
        direct = httpx.post(workers[0]["url"] + "/generate", json=body, timeout=60)
        assert via.status_code == direct.status_code == 400
        assert via.json() == direct.json()
    msg = ca.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}}).json()["error"]["message"]
    assert msg.startswith("sampling_params.temperature")
    r = ca.post("/generate", content=b'{"text": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: malformed JSON")
    r = ca.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": -3})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_info_routes(ca, workers):
    assert ca.get("/health").status_code == 200
    generate(ca, "A text prompt teaches the router how many characters make a token.")
    # The router answers from one worker; each worker stamps "created" with its own start time.
    direct = [httpx.get(w["url"] + "/v1/models").json() for w in workers]
    assert ca.get("/v1/models").json() in direct
    assert ca.get("/get_model_info").json() == httpx.get(workers[1]["url"] + "/get_model_info").json()
    info = wait_idle(ca, timeout=180)  # a cold compilation cache makes the first CPU steps slow
    assert info["running_requests"] == info["waiting_requests"] == 0, info
    own = [httpx.get(w["url"] + "/get_server_info", timeout=60).json() for w in workers]
    assert info["num_workers"] == info["healthy_workers"] == 2
    assert info["prompt_tokens"] == sum(i["prompt_tokens"] for i in own)
    assert info["cached_tokens"] == sum(i["cached_tokens"] for i in own)
    assert info["max_total_tokens"] == sum(i["max_total_tokens"] for i in own)
    assert [w["info"]["page_size"] for w in info["workers"]] == [16, 16]
    router = info["router"]
    assert router["policy"] == "cache_aware" and set(router["dispatch_counts"]) == {w["url"] for w in workers}
    assert sum(router["dispatch_counts"].values()) >= 1
    assert router["meta_tree"]["capacity"] == {w["url"]: i["max_total_tokens"] for w, i in zip(workers, own)}
    # learnt from the answers' prompt_tokens (the default before any answer is 4.0)
    assert 2.0 < router["meta_tree"]["chars_per_token"] < 8.0 and router["meta_tree"]["chars_per_token"] != 4.0


def _run(client: httpx.Client, order) -> tuple[int, dict]:
    """Send the few-shot requests one after another: (cached tokens of all answers, group -> workers used)."""
    cached, where = 0, {"A": set(), "B": set()}
    for group, q in order:
        r = generate(client, few_shot(group, q), max_new_tokens=2)
        cached += r.json()["meta_info"]["cached_tokens"]
        where[group].add(r.headers[WORKER_HEADER])
    return cached, where


def test_cache_aware_keeps_prefixes_together_and_caches_more_than_round_robin(ca, rr):
    order = [("A", 1), ("A", 2), ("B", 1), ("B", 2), ("A", 3), ("B", 3)]
    results = {}
    for name, client in (("round_robin", rr), ("cache_aware", ca)):
        assert ca.post("/flush_cache").status_code == 200  # both workers, and the cache_aware router's tree
        before = ca.get("/get_server_info").json()["cached_tokens"]
        cached, where = _run(client, order)
        after = ca.get("/get_server_info").json()["cached_tokens"]
        assert after - before == cached  # the aggregated counters agree with the answers
        results[name] = (cached, where)
    (rr_cached, rr_where), (ca_cached, ca_where) = results["round_robin"], results["cache_aware"]
    # cache_aware: each group on one worker, the two groups on different workers; round_robin spreads them
    assert len(ca_where["A"]) == len(ca_where["B"]) == 1 and ca_where["A"] != ca_where["B"]
    assert len(rr_where["A"]) == len(rr_where["B"]) == 2
    # Each hit reuses its group's prefix pages: cache_aware hits on A2, A3, B2, B3, round_robin only on A3 and B3
    # (A1, A2 and B1, B2 land on different workers).
    assert ca_cached == 2 * rr_cached > 0, (ca_cached, rr_cached)


@pytest.fixture(scope="module")
def sgl(workers):
    """SGLang's Rust router (sglang-router) in front of the same two workers, started with the command
    `sgjax serve --dp-size N --router sglang` runs (router/launch.py)."""
    ns = argparse.Namespace(host="127.0.0.1", port="{port}", router_policy="cache_aware", log_level="warning")
    ns.api_key = None
    # health checks each second: a dead worker leaves the rotation within seconds (sglang-router's default is 60 s)
    health = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    # not its default metrics port 29000, which another test's router may hold (two test files run at once)
    cmd = sglang_router_command(ns, [w["url"] for w in workers]) + health + ["--prometheus-port", str(free_port())]
    proc = ServerProcess(argv=cmd, log_prefix="sglang-router-")
    proc.wait_ready(timeout=120)
    with httpx.Client(base_url=proc.url, timeout=300) as c:
        yield c
    assert proc.stop() == 0, proc.log_text()
    proc.remove_log()


def _cached(workers) -> list[int]:
    return [httpx.get(w["url"] + "/get_server_info", timeout=60).json()["cached_tokens"] for w in workers]


def test_sglang_router_serves_generate_the_openai_routes_and_streams(sgl, workers):
    prompt = "The three primary colors are"
    direct = httpx.post(workers[0]["url"] + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=300)
    r = generate(sgl, prompt)
    assert r.json()["text"] == direct.json()["text"] and r.json()["output_ids"] == direct.json()["output_ids"]
    assert sgl.get("/health").status_code == 200
    client = openai.OpenAI(base_url=str(sgl.base_url) + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name a fruit."}]
    own = openai.OpenAI(base_url=workers[1]["url"] + "/v1", api_key="none")
    want = own.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    got = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.choices[0].message.content
    assert [m.id for m in client.models.list().data]
    two = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0, n=2)
    assert [c.message.content for c in two.choices] == [want.choices[0].message.content] * 2


def test_sglang_router_cache_aware_keeps_a_prefix_on_one_worker(sgl, ca, workers):
    assert ca.post("/flush_cache").status_code == 200
    before = _cached(workers)
    for q in (1, 2, 3):
        generate(sgl, few_shot("A", q), max_new_tokens=2)
    gained = [a - b for a, b in zip(_cached(workers), before)]
    assert sorted(gained)[0] == 0 and sorted(gained)[1] > 0, gained  # every hit on one worker
    assert sgl.post("/flush_cache").status_code == 200  # passed on to the workers


def test_a_client_that_leaves_a_stream_aborts_it_on_the_worker(ca, workers):
    body = {"text": "Count slowly:", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with ca.stream("POST", "/generate", json=body) as r:
        served = r.headers[WORKER_HEADER]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    with httpx.Client(base_url=served, timeout=60) as worker:
        info = wait_idle(worker, timeout=60)  # the worker saw the disconnect and aborted the request
    assert info["running_requests"] == info["waiting_requests"] == 0
    deadline = time.monotonic() + 30
    while (
        any(w["in_flight"] for w in ca.get("/get_server_info").json()["router"]["workers"])
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert all(w["in_flight"] == 0 for w in ca.get("/get_server_info").json()["router"]["workers"])


def test_a_client_that_leaves_a_stream_through_sglang_router_aborts_it_on_the_worker(sgl, workers):
    """sglang-router passes the client's disconnect on: the worker aborts the request and frees its pages."""
    body = {"text": "Count slowly:", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with sgl.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        busy = [httpx.get(w["url"] + "/get_server_info", timeout=60).json()["running_requests"] for w in workers]
        assert sum(busy) == 1, busy
    for w in workers:
        with httpx.Client(base_url=w["url"], timeout=60) as worker:
            info = wait_idle(worker, timeout=60)
        assert info["running_requests"] == info["waiting_requests"] == 0


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_killing_a_worker_sends_later_requests_to_the_other(ca, workers, sgl):
    assert ca.post("/flush_cache").status_code == 200
    first = generate(ca, few_shot("A", 7), max_new_tokens=2).headers[WORKER_HEADER]
    victim = next(w for w in workers if w["url"] == first)
    survivor = next(w for w in workers if w["url"] != first)
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _dead(victim["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(victim["pid"])
    # The meta-tree still sends this prefix to the dead worker: the request fails over to the other one.
    r = generate(ca, few_shot("A", 8), max_new_tokens=2)
    assert r.headers[WORKER_HEADER] == survivor["url"]
    for q in range(3):
        assert generate(ca, few_shot("B", q), max_new_tokens=2).headers[WORKER_HEADER] == survivor["url"]
    with ca.stream("POST", "/generate", json={"text": "Hi", "stream": True, "sampling_params": GREEDY}) as s:
        assert sse_events(s.iter_lines())[-1] == "[DONE]"
    info = ca.get("/get_server_info").json()
    state = {w["url"]: w for w in info["router"]["workers"]}
    assert not state[victim["url"]]["healthy"] and state[survivor["url"]]["healthy"]
    assert info["healthy_workers"] == 1 and "error" in info["workers"][workers.index(victim)]
    # SGLang's router does not retry a request that meets the dead worker (a 500 naming the upstream error), but its
    # health checks take the worker out of rotation, and then every request is served by the other one
    deadline, served = time.monotonic() + 30, 0
    while served < 4 and time.monotonic() < deadline:
        r = sgl.post("/generate", json={"text": few_shot("A", 10 + served), "sampling_params": GREEDY})
        served = served + 1 if r.status_code == 200 else 0
        if r.status_code != 200:
            assert r.status_code >= 500 and "upstream" in r.text, r.text
            time.sleep(0.5)
    assert served == 4


def test_sigterm_on_the_launcher_exits_0_and_stops_its_workers(launcher, workers, rr_router):
    rr_router.stop()  # fronts the same workers; stopped first so that nothing else talks to them
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(90) == 0, launcher.log_text()
    for w in workers:
        assert _dead(w["pid"]), f"worker {w['pid']} still running"
        try:
            os.kill(w["pid"], 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"worker {w['pid']} not reaped"
    log = launcher.log_text(20000)
    assert "worker 0:" in log and "worker 1:" in log
    launcher.remove_log()
