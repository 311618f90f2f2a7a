"""SGLang's router in DP-aware mode (`launch_router --dp-aware`) in front of one `sgjax serve --dp-size 2`: it reads
the worker URL's `dp_size` from /server_info, registers one worker per rank (`URL@0`, `URL@1`), and sends each
request to the URL with `data_parallel_rank` set to its rank; our router sends rank r to its worker r, whatever its
own policy would pick. A plain `sgjax serve` is one engine: rank 0 of dp_size 1, and any other rank is a 400 naming
the field. Request ids: sglang-router echoes a client's `x-request-id` and passes it on, but, as SGLang's server,
sgjax takes a request's rid from the body only (docs/router.md)."""

import sys
import time

import httpx
import openai
import pytest

from sgjax.server import fields
from sgjax.server.process import ServerProcess, free_port
from sgjax.server.protocol import ApiError
from tests.conftest import TINY_SERVE
from tests.router.conftest import start
from tests.server.conftest import sse_events

PARAMS = {"max_new_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["data_parallel_rank", "routed_dp_rank"])
def test_one_engine_takes_rank_0_and_refuses_others_by_name(route, field):
    screen = fields.screener(route)
    for unset in (None, 0):
        assert field not in screen({field: unset})  # accepted, and dropped before the route's model
    for rank in (1, -1, "0", True, 0.0):
        with pytest.raises(ApiError) as e:
            screen({field: rank})
        assert e.value.status == 400 and e.value.param == field and e.value.message.startswith(f"{field}: out of range")


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, smollm2_path):
    """`sgjax serve --dp-size 2` on the tiny checkpoint: our router (cache_aware) over two one-engine workers."""
    flags = ["--model-path", tiny_checkpoint, "--load-format", "dummy", "--tokenizer-path", smollm2_path]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SERVE.items()]
    proc = start("serve", *flags, "--dp-size", "2", "--router-policy", "cache_aware")
    yield proc
    assert proc.stop() == 0, proc.log_text()
    proc.remove_log()


@pytest.fixture(scope="module")
def workers(fleet) -> list[str]:
    return [w["url"] for w in httpx.get(fleet.url + "/get_server_info", timeout=60).json()["router"]["workers"]]


@pytest.fixture(scope="module")
def sgl(fleet):
    """sglang-router --dp-aware with the single worker URL of the whole fleet; round_robin, so ranks alternate."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "{port}"]
    cmd += ["--worker-urls", fleet.url, "--dp-aware", "--policy", "round_robin", "--log-level", "warn"]
    cmd += ["--prometheus-port", str(free_port())]  # not its default 29000: another router may hold it
    proc = ServerProcess(argv=cmd, log_prefix="sglang-router-dp-").wait_ready(timeout=120)
    deadline, ranks = time.monotonic() + 60, []
    while time.monotonic() < deadline:  # it registers workers in the background, after answering /health
        ranks = sorted(
            w["url"] for w in httpx.get(proc.url + "/workers", timeout=10).json()["workers"] if w["is_healthy"]
        )
        if len(ranks) == 2:
            break
        time.sleep(0.2)
    assert ranks == [fleet.url + "@0", fleet.url + "@1"], (ranks, proc.log_text())  # it read our dp_size
    yield proc
    assert proc.stop() == 0, proc.log_text()
    proc.remove_log()


def _state(fleet, workers) -> tuple[list[int], list[int]]:
    """Per worker, in rank order: requests our router sent it, and prompt tokens its engine received."""
    info = httpx.get(fleet.url + "/get_server_info", timeout=60).json()
    sent = [info["router"]["dispatch_counts"][u] for u in workers]
    tokens = {w["url"]: w["info"]["prompt_tokens"] for w in info["workers"]}
    return sent, [tokens[u] for u in workers]


def test_fleet_reports_its_dp_size_and_a_worker_is_rank_0_of_1(fleet, workers):
    assert httpx.get(fleet.url + "/server_info", timeout=60).json()["dp_size"] == 2
    w = workers[1]
    assert httpx.get(w + "/server_info", timeout=60).json()["dp_size"] == 1
    body = {"text": "Hello", "sampling_params": PARAMS}
    assert httpx.post(w + "/generate", json={**body, "data_parallel_rank": 0}, timeout=120).status_code == 200
    r = httpx.post(w + "/generate", json={**body, "data_parallel_rank": 1}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "data_parallel_rank", r.text
    assert err["message"].startswith("data_parallel_rank: out of range [0, 1)"), err
    chat = openai.OpenAI(base_url=w + "/v1", api_key="-", max_retries=0).chat.completions
    with pytest.raises(openai.BadRequestError) as e:
        chat.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"routed_dp_rank": 3}
        )
    assert e.value.body["param"] == "routed_dp_rank"


def test_our_router_sends_a_named_rank_to_that_worker(fleet, workers):
    before, _ = _state(fleet, workers)
    body = {"text": "The same prompt each time", "sampling_params": PARAMS}
    served = []
    for rank in (1, 1, 0, 1):  # cache_aware alone would keep this prompt on one worker
        r = httpx.post(fleet.url + "/generate", json={**body, "data_parallel_rank": rank}, timeout=120)
        assert r.status_code == 200, r.text
        served.append(r.headers["x-sgjax-worker"])
    assert served == [workers[1], workers[1], workers[0], workers[1]]
    r = httpx.post(fleet.url + "/generate", json={**body, "routed_dp_rank": 0, "data_parallel_rank": 1}, timeout=120)
    assert r.headers["x-sgjax-worker"] == workers[0]  # SGLang's own name wins, as in SGLang
    after, _ = _state(fleet, workers)
    assert [a - b for a, b in zip(after, before)] == [2, 3]
    r = httpx.post(fleet.url + "/generate", json={**body, "data_parallel_rank": 2}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "data_parallel_rank" and "[0, 2)" in err["message"], r.text
    assert _state(fleet, workers)[0] == after  # refused by the router: no worker saw it


def test_sglang_router_dp_aware_sends_each_rank_to_its_worker(sgl, fleet, workers):
    sent0, tokens0 = _state(fleet, workers)
    prompt = "A prompt sglang-router sends to rank 0, then rank 1, and so on"
    answers = [
        httpx.post(sgl.url + "/generate", json={"text": prompt, "sampling_params": PARAMS}, timeout=120)
        for _ in range(4)
    ]
    assert all(r.status_code == 200 and r.json()["output_ids"] for r in answers), [r.text for r in answers]
    assert len({tuple(r.json()["output_ids"]) for r in answers}) == 1  # greedy: the same answer from either rank
    client = openai.OpenAI(base_url=sgl.url + "/v1", api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "Name a fruit."}]
    for _ in range(2):
        assert client.chat.completions.create(model="default", messages=messages, max_tokens=3, temperature=0).choices
        assert client.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0).choices
    with httpx.stream(
        "POST", sgl.url + "/generate", json={"text": prompt, "stream": True, "sampling_params": PARAMS}, timeout=120
    ) as r:
        assert r.status_code == 200 and sse_events(r.iter_lines())[-1] == "[DONE]"
    sent, tokens = _state(fleet, workers)
    # 9 requests, alternating ranks: 5 to one worker, 4 to the other. Our router's own policy (cache_aware) would
    # have kept the repeated prompt on one worker; each engine received prompts.
    assert sorted(a - b for a, b in zip(sent, sent0)) == [4, 5], (sent0, sent)
    assert all(a > b for a, b in zip(tokens, tokens0)), (tokens0, tokens)


def test_request_ids_through_sglang_router(sgl):
    """sglang-router echoes the client's x-request-id (or its own) and passes the client's on to the worker; the
    request's rid is the body's `rid`, as in SGLang's server, which does not read the header."""
    body = {"text": "Hello", "sampling_params": PARAMS}
    r = httpx.post(
        sgl.url + "/generate", json={**body, "rid": "mine-1"}, headers={"x-request-id": "trace-1"}, timeout=120
    )
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "mine-1", r.text
    assert r.headers["x-request-id"] == "trace-1"
    r = httpx.post(sgl.url + "/generate", json=body, headers={"x-request-id": "trace-2"}, timeout=120)
    assert r.headers["x-request-id"] == "trace-2" and r.json()["meta_info"]["id"] != "trace-2"
    r = httpx.post(sgl.url + "/generate", json=body, timeout=120)
    assert r.headers["x-request-id"].startswith("gnt-")  # the router's own id, which workers never see
