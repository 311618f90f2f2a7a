"""Prefill/decode disaggregation behind SGLang's own router: `sglang_router.launch_router --pd-disaggregation` in
front of an `sgjax serve --disaggregation-mode prefill` worker (its bootstrap port named to the router) and a
`--disaggregation-mode decode` one. The openai client's answers through the router equal a single engine's, the
decode worker took the prompts' pages from the prefill worker (pulled through jax's transfer, the default where it
works), and after 50 more requests (a third of them streams the client drops) neither worker holds a page."""

import sys

import httpx
import openai
import pytest

from sgjax.engine.disagg_transfer import unavailable
from sgjax.engine.engine import Engine
from sgjax.server.process import ServerProcess, free_ports
from tests.conftest import TINY_SERVE
from tests.server.conftest import serving, sse_events, wait_idle

MESSAGES = [{"role": "user", "content": "Write three sentences about the sea, the sky and the mountains, please."}]


@pytest.fixture(scope="module")
def workers(tiny_checkpoint, smollm2_path):
    (port,) = free_ports(1)
    flags = ["--model-path", tiny_checkpoint, "--load-format", "dummy", "--tokenizer-path", smollm2_path]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SERVE.items()]
    prefill = serving(*flags, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port))
    decode = serving(*flags, "--disaggregation-mode", "decode")
    p, d = next(prefill), next(decode)
    yield p, d, port
    for gen in (prefill, decode):
        next(gen, None)  # stops the server and checks its exit status


@pytest.fixture(scope="module")
def router(workers):
    p, d, port = workers
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "{port}"]
    cmd += ["--pd-disaggregation", "--prefill", p.url, str(port), "--decode", d.url, "--log-level", "warn"]
    proc = ServerProcess(argv=cmd, log_prefix="sglang-router-pd-")
    proc.wait_ready(timeout=120)
    yield proc
    assert proc.stop() == 0, proc.log_text()
    proc.remove_log()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, smollm2_path):
    with Engine(tiny_checkpoint, load_format="dummy", tokenizer_path=smollm2_path, **TINY_SERVE) as engine:
        yield engine


def test_answers_through_the_pd_router_equal_a_single_engines(router, workers, reference):
    p, d, _ = workers
    prompt = reference.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = reference.generate(prompt, {"max_new_tokens": 16, "temperature": 0})["text"]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    got = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    text = "Once upon a time, in a village by the sea, there lived an old fisherman who"
    body = {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    r = httpx.post(router.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text"] == reference.generate(text, body["sampling_params"])["text"]
    with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True}, timeout=120) as s:
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["text"] == r.json()["text"]
    info = httpx.get(d.url + "/get_server_info").json()
    assert info["disaggregation_mode"] == "decode" and info["disaggregation_received_tokens"] >= 32
    if unavailable() is None:  # the default (auto) pulls the pages device to device; none came on the socket
        assert info["disaggregation_transfer_backend"] == "jax" and info["disaggregation_pulls"] >= 4
        assert info["disaggregation_socket_kv_bytes"] == 0
    for worker in (p, d):
        with httpx.Client(base_url=worker.url, timeout=60) as c:
            info = wait_idle(c)
        assert info["protected_pages"] == 0 and info["free_pages"] + info["evictable_pages"] == info["num_pages"]


def test_fifty_requests_with_dropped_streams_leave_no_page_on_either_worker(router, workers):
    """Concurrent requests through the PD router, a third of them streams the client leaves early: both workers end
    idle with every page free or cached."""
    import concurrent.futures
    import random

    p, d, _ = workers
    rng = random.Random(0)

    def one(i: int) -> int:
        text = f"Request {i}: " + "tell me about the weather and the sea " * rng.randint(1, 6)
        body = {"text": text, "sampling_params": {"max_new_tokens": rng.randint(1, 24), "temperature": 0}}
        if i % 3:
            return httpx.post(router.url + "/generate", json=body, timeout=120).status_code
        body["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True}, timeout=120) as s:
            lines = s.iter_lines()
            next(lines)  # one event, then the client goes
            return s.status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(50))) == {200}
    for worker in (p, d):
        with httpx.Client(base_url=worker.url, timeout=60) as c:
            info = wait_idle(c, timeout=120)
        assert info["running_requests"] == info["waiting_requests"] == 0
        assert info["protected_pages"] == 0 and info["free_pages"] + info["evictable_pages"] == info["num_pages"]
