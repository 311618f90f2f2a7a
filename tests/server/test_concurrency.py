"""32 concurrent streaming clients, a quarter of them leaving midway; disconnects of long requests. Every finished
stream is complete and not duplicated, disconnects abort (nothing keeps running), no page leaks, /health stays fast
and the server keeps serving."""

import asyncio
import json
import statistics
import time
from contextlib import aclosing

import httpx

from tests.engine.conftest import PROMPTS
from tests.server.conftest import assert_no_leak

NEW = 8
DISTINCT = PROMPTS[5:13]


async def sse(http, route, body):
    """The decoded events of an SSE stream; [DONE] must come once, last. Closing it early (aclosing) closes the
    connection mid-stream: the client leaves."""
    done = 0
    async with http.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done += 1
            elif payload:
                assert done == 0, "an event after [DONE]"
                yield json.loads(payload)
    assert done == 1


async def stream_generate(http, prompt, leave_after):
    """A /generate stream's final text, its events checked to be cumulative; None when leaving after
    `leave_after` events."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}, "stream": True}
    events = []
    async with aclosing(sse(http, "/generate", body)) as stream:
        async for event in stream:
            if events:
                assert events[-1]["meta_info"]["finish_reason"] is None, "an event after the final one"
                assert event["text"].startswith(events[-1]["text"])
                assert event["output_ids"][: len(events[-1]["output_ids"])] == events[-1]["output_ids"]
            events.append(event)
            if len(events) == leave_after:
                return None
    return events[-1]["text"]


async def stream_completion(http, prompt, leave_after):
    """An OpenAI completions stream: the concatenated deltas (a duplicated or lost chunk would change them)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True}
    text, chunks, finished = "", 0, 0
    async with aclosing(sse(http, "/v1/completions", body)) as stream:
        async for event in stream:
            choice = event["choices"][0]
            assert finished == 0, "a chunk after the final one"
            text += choice["text"]
            finished += choice["finish_reason"] is not None
            chunks += 1
            if chunks == leave_after:
                return None
    assert finished == 1
    return text


async def poll_health(url, stop: asyncio.Event, latencies: list):
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert (await http.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)


def test_32_streaming_clients_some_leaving(client, url):
    reference = [
        r["text"]
        for r in client.post(
            "/generate", json={"text": DISTINCT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
        ).json()
    ]

    async def main():
        stop, latencies = asyncio.Event(), []
        health = asyncio.create_task(poll_health(url, stop, latencies))
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            jobs = []
            for i in range(32):
                run = stream_generate if i % 2 == 0 else stream_completion
                jobs.append(run(http, DISTINCT[i % len(DISTINCT)], leave_after=2 if i % 4 == 3 else None))
            results = await asyncio.gather(*jobs)
        stop.set()
        await health
        return results, latencies

    results, latencies = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 4 == 3:
            assert text is None
        else:
            assert text == reference[i % len(DISTINCT)], f"client {i}"
    assert_no_leak(client)
    # The engine runs in its own thread; /health is answered on the event loop without waiting for a step.
    assert len(latencies) >= 10 and statistics.median(latencies) < 0.1, sorted(latencies)
    out = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["completion_tokens"] == 2


def long_request(stream: bool) -> dict:
    return {
        "text": "Once upon a time",
        "stream": stream,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }


def wait_running(client, n: int, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while client.get("/get_server_info").json()["running_requests"] != n:
        assert time.monotonic() - t0 < timeout, f"running_requests never became {n}"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_non_streaming_client_that_disconnects_aborts_its_request(client, url):
    try:
        httpx.post(url + "/generate", json=long_request(False), timeout=2.0)
        raise AssertionError("3000 tokens cannot be ready in 2 s on CPU")
    except httpx.ReadTimeout:
        pass  # the client closes the connection
    assert wait_running(client, 0) < 10  # aborted, not run to 3000 tokens
    assert_no_leak(client)


def test_a_streaming_client_that_disconnects_aborts_its_request(client, url):
    with httpx.stream("POST", url + "/generate", json=long_request(True), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert wait_running(client, 0) < 10
    assert_no_leak(client)
