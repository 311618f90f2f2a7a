"""SGLang's native API over real HTTP: /generate against the in-process Engine, streaming, constrained decoding,
info routes, the cache, abort and /metrics."""

import json
import time

import httpx
import jsonschema
import pytest

from sgjax.engine.engine import Engine
from tests.conftest import SMALL
from tests.engine.conftest import PROMPTS
from tests.server.conftest import assert_no_leak, sse_events

GREEDY = {"max_new_tokens": 12, "temperature": 0}
SAMPLED = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 11, "n": 2}


@pytest.fixture(scope="module")
def engine(smollm2):
    # The server's model and settings (tests/conftest.py: the defaults users get, auto's plan), so both run the same
    # batches; the weights are loaded once per process (engine/loading.py).
    with Engine(**SMALL) as eng:
        yield eng


def same(http_result, engine_result):
    """Equal but for the request id; JSON turns the engine's logprob tuples into lists."""
    a = json.loads(json.dumps(http_result))
    b = json.loads(json.dumps(engine_result))
    for x in (a if isinstance(a, list) else [a]) + (b if isinstance(b, list) else [b]):
        x["meta_info"].pop("id")
    return a == b


@pytest.mark.parametrize(
    "body, call",
    [
        ({"text": PROMPTS[0], "sampling_params": GREEDY}, lambda e: e.generate(PROMPTS[0], GREEDY)),
        ({"text": PROMPTS[5:8], "sampling_params": GREEDY}, lambda e: e.generate(PROMPTS[5:8], GREEDY)),
        ({"text": PROMPTS[9], "sampling_params": SAMPLED}, lambda e: e.generate(PROMPTS[9], SAMPLED)),
        (
            {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}]},
            lambda e: e.generate(
                input_ids=[[1, 2, 3, 4], [5, 6, 7]], sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}]
            ),
        ),
        (
            {
                "text": PROMPTS[1],
                "sampling_params": {**GREEDY, "max_new_tokens": 4},
                "return_logprob": True,
                "logprob_start_len": 2,
                "top_logprobs_num": 3,
            },
            lambda e: e.generate(
                PROMPTS[1],
                {**GREEDY, "max_new_tokens": 4},
                return_logprob=True,
                logprob_start_len=2,
                top_logprobs_num=3,
            ),
        ),
    ],
    ids=["single", "batch", "sampled-n2", "input-ids-batch", "logprobs"],
)
def test_generate_equals_the_engine(client, engine, body, call):
    assert client.post("/flush_cache").json()["success"]  # cached_tokens must match too: both start empty
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert engine.flush_cache()
    assert same(r.json(), call(engine))


def test_generate_stream_is_cumulative_and_ends_with_done(client):
    full = client.post("/generate", json={"text": PROMPTS[10], "sampling_params": GREEDY}).json()
    with client.stream("POST", "/generate", json={"text": PROMPTS[10], "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["index"] == 0 for c in chunks)
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_generate_stream_of_a_batch_with_n(client):
    body = {"text": PROMPTS[9:11], "sampling_params": SAMPLED}
    full = client.post("/generate", json=body).json()
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    last = {}
    for c in events[:-1]:
        assert c["index"] not in last or last[c["index"]]["meta_info"]["finish_reason"] is None  # nothing after end
        last[c["index"]] = c
    assert sorted(last) == [0, 1, 2, 3]
    # Copy j of a seeded prompt gets seed + j in both forms, so the streams equal the one-shot results.
    assert [last[i]["output_ids"] for i in range(4)] == [f["output_ids"] for f in full]
    assert len({tuple(f["output_ids"]) for f in full[:2]}) == 2


def test_regex_and_json_schema(client):
    out = client.post(
        "/generate",
        json={
            "text": "My phone number is",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": r" \d{3}-\d{4}"},
        },
    ).json()
    assert out["text"][1:4].isdigit() and out["text"][4] == "-" and len(out["text"]) == 9
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }
    out = client.post(
        "/generate",
        json={
            "text": "A person as JSON:",
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)},
        },
    ).json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(out["text"]), schema)


def test_return_text_in_logprobs(client, smollm2):
    tok = smollm2[2]
    out = client.post(
        "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    entries = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in entries] == out["output_ids"]
    assert "".join(text for _, _, text in entries) == tok.decode(out["output_ids"])
    for row in out["meta_info"]["output_top_logprobs"]:
        assert len(row) == 2 and all(isinstance(text, str) for _, _, text in row)


def test_info_routes(client, smollm2_path):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == smollm2_path and info["is_generation"] is True
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["served_model_name"]
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    server = client.get("/get_server_info").json()
    for key in ("cache_hit_rate", "max_total_tokens", "running_requests", "waiting_requests", "server_args", "version"):
        assert key in server
    assert server["server_args"]["max_running_requests"] == 8 and server["max_total_tokens"] == 4096


def test_cache_hits_show_in_server_info_and_flush_clears_them(client):
    prompt = PROMPTS[0]  # a few-shot prompt of several pages
    assert client.post("/flush_cache").json()["success"] is True
    before = client.get("/get_server_info").json()
    first = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    second = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] >= 48
    after = client.get("/get_server_info").json()
    assert after["cached_tokens"] - before["cached_tokens"] == second["meta_info"]["cached_tokens"]
    assert after["cache_hit_rate"] == after["cached_tokens"] / after["prompt_tokens"] > 0
    assert client.get("/flush_cache").json()["success"] is True
    assert client.get("/get_server_info").json()["evictable_pages"] == 0
    third = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert third["meta_info"]["cached_tokens"] == 0


def test_abort_request_by_rid(client, url):
    import threading

    result = {}

    def run():
        result["r"] = httpx.post(
            url + "/generate",
            json={
                "text": "Once upon a time",
                "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            },
            timeout=120,
        )

    t = threading.Thread(target=run)
    t.start()
    while client.get("/get_server_info").json()["running_requests"] == 0:
        time.sleep(0.05)
    refused = client.post("/flush_cache")  # as SGLang: not while requests run
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("flush_cache:")
    assert client.post("/abort_request", json={"rid": "to-abort"}).json()["success"] is True
    t.join(60)
    out = result["r"].json()
    assert out["meta_info"]["id"] == "to-abort" and out["meta_info"]["finish_reason"] == {"type": "abort"}
    assert out["meta_info"]["completion_tokens"] < 3000
    assert_no_leak(client)


def test_metrics_in_prometheus_format(client):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {f.name: f for f in text_string_to_metric_families(r.text)}

    def value(families, name, **labels):
        return sum(
            s.value
            for f in families.values()
            for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    before = scrape()
    out = client.post(
        "/generate", json={"text": PROMPTS[11], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    ).json()
    with client.stream(
        "POST", "/generate", json={"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 1}}
    ) as r:
        r.read()
    after = scrape()
    kinds = {
        "sgjax:num_requests": "counter",
        "sgjax:prompt_tokens": "counter",
        "sgjax:generation_tokens": "counter",
        "sgjax:cached_tokens": "counter",
        "sgjax:num_queue_reqs": "gauge",
        "sgjax:num_running_reqs": "gauge",
        "sgjax:cache_hit_rate": "gauge",
        "sgjax:step_time_seconds": "histogram",
        "sgjax:e2e_request_latency_seconds": "histogram",
        "sgjax:time_to_first_token_seconds": "histogram",
        "sgjax:token_usage": "gauge",
        "sgjax:num_retractions": "counter",
    }
    for name, kind in kinds.items():
        assert after[name].type == kind, name
    meta = out["meta_info"]
    assert value(after, "sgjax:generation_tokens_total") - value(before, "sgjax:generation_tokens_total") == 5 + 1
    assert (
        value(after, "sgjax:prompt_tokens_total") - value(before, "sgjax:prompt_tokens_total")
        == meta["prompt_tokens"] + 1
    )  # "Hi" is one token
    assert (
        value(after, "sgjax:num_requests_total", endpoint="/generate", status="200")
        == value(before, "sgjax:num_requests_total", endpoint="/generate", status="200") + 2
    )
    for name in ("sgjax:e2e_request_latency_seconds_count", "sgjax:time_to_first_token_seconds_count"):
        assert value(after, name) - value(before, name) == (2 if "e2e" in name else 1), name
    assert value(after, "sgjax:num_running_reqs") == value(after, "sgjax:num_queue_reqs") == 0
    steps = value(after, "sgjax:step_time_seconds_count") - value(before, "sgjax:step_time_seconds_count")
    assert steps >= 5  # one prefill, four decodes at least
    buckets = [s for s in after["sgjax:step_time_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == value(after, "sgjax:step_time_seconds_count")
