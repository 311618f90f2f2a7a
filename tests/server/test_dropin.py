"""Drop-in for SGLang and OpenAI clients: the request policy (server/fields.py), stop_regex, SGLang's and vLLM's extra
routes, the OpenAI error shape, embeddings against HF, and the flags (--api-key on every route, --max-queued-requests,
--stream-interval), against the real server on SmolLM2 with the official openai client where it applies."""

import base64
import re
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from sgjax.server import fields
from sgjax.server.app import OPEN_ROUTES, ROUTES
from tests.server.conftest import SMALL_FLAGS, serving, sse_events, wait_idle

CHAT = [{"role": "user", "content": "Say hi."}]


def real_value(name: str, policy):
    """A value that really asks for the feature (not null, empty or a default)."""
    special = {"modalities": ["audio"], "function_call": "auto", "beam_width": 4, "routed_experts_start_len": 3}
    if name in special:
        return special[name]
    if policy.defaults == (False,):
        return True
    return {"enabled": True} if name.endswith(("params", "kwargs", "config", "options")) else "x"


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


@pytest.mark.parametrize("route, table", [("chat", fields.CHAT), ("completions", fields.COMPLETIONS)])
def test_openai_client_unsupported_fields_at_their_defaults_pass_and_real_values_are_refused_by_name(oai, route, table):
    create = oai.chat.completions.create if route == "chat" else oai.completions.create
    base = dict(model="m", max_tokens=1, temperature=0, **({"messages": CHAT} if route == "chat" else {"prompt": "Hi"}))
    unset = {name: None for name in table}
    unset.update({name: p.defaults[0] for name, p in table.items() if isinstance(p, fields.Unsupported) and p.defaults})
    meta = {name: "anything" for name, p in table.items() if isinstance(p, fields.Meta)}
    assert create(**base, extra_body={**unset, **meta, "no_such_field": 1}).choices  # all at once: one generation
    for name, policy in table.items():
        if isinstance(policy, fields.Unsupported):
            with pytest.raises(openai.BadRequestError) as e:
                create(**base, extra_body={name: real_value(name, policy)})
            err = e.value.body
            assert (
                err["param"] == name
                and err["message"].startswith(f"{name}: ")
                and err["code"] == "unsupported_parameter"
            ), err


def test_generate_fields_and_sampling_params(client):
    body = {
        "text": "Hi",
        "sampling_params": {
            "max_new_tokens": 1,
            "temperature": 0,
            "stop_regex": [],
            "ebnf": None,
            "custom_params": None,
            "stream_interval": 3,
        },
        "lora_path": None,
        "return_hidden_states": False,
        "rid": "r-1",
        "priority": 3,
        "extra_key": "k",
        "log_metrics": True,
        "no_such_field": {"a": 1},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == "r-1"
    for key, value in (("lora_path", "adapter-1"), ("return_hidden_states", True), ("session_params", {"id": 1})):
        r = client.post("/generate", json={**body, key: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
    r = client.post("/generate", json={**body, "sampling_params": {"custom_params": {"a": 1}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.custom_params", r.text
    r = client.post("/generate", json={**body, "sampling_params": {"nucleus": 0.5}})  # unknown: refused, as upstream
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.nucleus", r.text
    r = client.put("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


def test_stop_regex_over_http_and_through_extra_body(client, oai):
    free = client.post(
        "/generate", json={"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
    ).json()
    pattern = re.escape(free["text"][4:7])  # a literal piece of the output
    out = client.post(
        "/generate",
        json={
            "text": "Count: 1, 2, 3,",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop_regex": pattern},
        },
    ).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert free["text"].startswith(out["text"]) and re.search(pattern, out["text"])
    done = oai.completions.create(
        model="m", prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0, extra_body={"stop_regex": [pattern]}
    )
    assert done.choices[0].text == out["text"] and done.choices[0].finish_reason == "stop"


def test_info_routes_with_sglangs_keys(client, server):
    info = client.get("/server_info").json()
    assert info["internal_states"] and info["internal_states"][0]["max_total_tokens"] == info["max_total_tokens"]
    assert info["tp_size"] == 1 and "version" in info and info["api_key"] is None
    assert client.get("/get_server_info").json()["max_total_tokens"] == info["max_total_tokens"]
    model = client.get("/model_info").json()
    assert model == client.get("/get_model_info").json() and model["is_generation"] is True
    name = client.get("/v1/models").json()["data"][0]["id"]
    assert client.get(f"/v1/models/{name}").json()["id"] == name
    r = client.get("/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/ready").status_code == 200


def test_tokenize_and_detokenize_in_sglangs_and_vllms_shapes(client, smollm2):
    tok = smollm2[2]
    one = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert one["tokens"] == tok.encode("Hello world") and one["count"] == len(one["tokens"]) and one["max_model_len"]
    many = client.post("/tokenize", json={"text": ["a b", "c"], "return_token_strs": True}).json()
    assert many["tokens"] == [tok.encode("a b"), tok.encode("c")] and len(many["token_strs"][0]) == many["count"][0]
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    back = client.post("/detokenize", json={"tokens": one["tokens"]}).json()
    assert back["text"] == back["prompt"] == tok.decode(one["tokens"], skip_special_tokens=False)
    r = client.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = client.post("/tokenize", json={"prompt": "a", "text": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.fixture(scope="module")
def engine(smollm2):
    """The in-process engine with the session server's settings (the defaults users get): the routes below give what
    its encode and score give (their HF parity: tests/engine/test_engine.py, in float32)."""
    from sgjax.engine.engine import Engine
    from tests.conftest import SMALL

    with Engine(**SMALL) as eng:
        yield eng


def test_embeddings_are_the_engines_unit_vectors(oai, engine):
    texts = ["The capital of France is Paris.", "Hello"]
    got = oai.embeddings.create(model="m", input=texts)
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
    want = engine.encode(texts)
    for item, vector in zip(got.data, want):
        np.testing.assert_allclose(np.asarray(item.embedding), vector, atol=1e-6)
        assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5
    b64 = oai.embeddings.create(model="m", input="Hello", encoding_format="base64").data[0].embedding
    assert np.allclose(np.frombuffer(base64.b64decode(b64), np.float32), got.data[1].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        oai.embeddings.create(model="m", input="Hello", dimensions=3)


def test_score_is_the_engines_next_token_probability_of_each_label(client, engine, smollm2):
    tok = smollm2[2]
    query, items = "The capital of France is", [" Paris", " London", " a"]
    labels = [tok.encode(" the")[0], tok.encode(" and")[0], tok.encode(".")[0]]
    got = client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels}).json()
    assert got["object"] == "scoring" and got["usage"]["completion_tokens"] == 0 and got["token_logprobs"] is None
    expected = engine.score(query, items, labels)
    np.testing.assert_allclose(got["scores"], expected, rtol=1e-5, atol=1e-7)
    # a softmax over the labels only, with a temperature; ids give what the same text gives; item_first
    soft = client.post(
        "/v1/score",
        json={"query": query, "items": items, "label_token_ids": labels, "apply_softmax": True, "temperature": 0.5},
    ).json()["scores"]
    e = np.log(np.asarray(expected)) / 0.5
    np.testing.assert_allclose(soft, np.exp(e) / np.exp(e).sum(-1, keepdims=True), rtol=2e-3)
    ids = client.post(
        "/v1/score",
        json={
            "query": tok.encode(query),
            "items": [tok.encode(" Paris")],
            "label_token_ids": labels,
            "return_token_logprobs": True,
        },
    ).json()
    np.testing.assert_allclose(ids["scores"][0], got["scores"][0], rtol=1e-4)
    np.testing.assert_allclose(np.exp(ids["token_logprobs"][0]), ids["scores"][0], rtol=1e-6)
    first = client.post(
        "/v1/score", json={"query": " is big.", "items": "Paris", "item_first": True, "label_token_ids": [labels]}
    ).json()["scores"]
    np.testing.assert_allclose(
        first[0], engine.score(" is big.", ["Paris"], [labels], item_first=True)[0], rtol=2e-3, atol=1e-6
    )
    assert client.post("/v1/score", json={"query": "q", "items": [], "label_token_ids": labels}).json()["scores"] == []
    for body, field in [
        ({"query": "q", "items": ["a"]}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [1, 1]}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [10**9]}, "label_token_ids"),
        ({"query": "q", "items": ["a", "b"], "label_token_ids": [[1], [2], [3]]}, "label_token_ids"),
        ({"query": "q", "items": ["a"], "label_token_ids": [1], "temperature": 2}, "temperature"),
        ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "items"),
        ({"query": "q", "label_token_ids": [1]}, "items"),
        ({"query": "", "items": [""], "label_token_ids": [1]}, "items"),
        (
            {"query": "q", "items": ["a"], "label_token_ids": [1], "score_extraction_token": "<s>"},
            "score_extraction_token",
        ),
    ]:
        r = client.post("/v1/score", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    ok = client.post(
        "/v1/score",
        json={
            "query": "q",
            "items": ["a"],
            "label_token_ids": [1],
            "return_pooled_hidden_states": False,
            "embed_override_token_id": None,
        },
    )
    assert ok.status_code == 200


def test_abort_all_ends_every_running_request(client, url):
    results = []

    def stream():
        with httpx.Client(base_url=url, timeout=120) as c:
            with c.stream(
                "POST",
                "/generate",
                json={
                    "text": "Tell a long story.",
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
                },
            ) as r:
                results.append(sse_events(r.iter_lines()))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while client.get("/get_server_info").json()["running_requests"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.post("/abort_request", json={"abort_all": True}).json() == {"success": True}
    for t in threads:
        t.join(60)
    assert [r[-2]["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
    r = client.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


@pytest.fixture(scope="module")
def locked():
    """A server with --api-key, one running request at most, one waiting at most, and chunks of 4 tokens. Its step
    shapes are compiled before the tests, and --request-timeout is 20 s: on a slow 2-core CPU (4-5 tokens/s for one
    SmolLM2 stream beside another test worker) the streaming test's 30 tokens passed an 8 s timeout."""
    for server in serving(
        *SMALL_FLAGS[:4],
        "--max-running-requests",
        "1",
        "--api-key",
        "sekret",
        "--max-queued-requests",
        "1",
        "--stream-interval",
        "4",
        "--enable-metrics",
        "--request-timeout",
        "20",
        "--header-timeout",
        "1",
    ):
        with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": "Bearer sekret"}) as c:
            for _ in range(3):  # a timed-out warm-up still leaves its compiled shapes behind
                r = c.post(
                    "/generate",
                    json={
                        "text": "Tell a long story.",
                        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
                    },
                )
                wait_idle(c)
                if r.status_code == 200:
                    break
        yield server


def test_api_key_guards_every_route_but_the_probes(locked):
    with httpx.Client(base_url=locked.url, timeout=60) as c:
        for route in ROUTES:
            method = (
                "GET"
                if route
                in (
                    "/v1/models",
                    "/health",
                    "/health_generate",
                    "/get_model_info",
                    "/get_server_info",
                    "/model_info",
                    "/server_info",
                    "/ready",
                    "/metrics",
                )
                else "POST"
            )
            r = c.request(method, route, json={})
            if route in OPEN_ROUTES:
                assert r.status_code == 200, route
            else:
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", route
            wrong = c.request(method, route, json={}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == (200 if route in OPEN_ROUTES else 401), route
        ok = c.get("/get_server_info", headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["api_key"] == "<set>"  # never the key itself
    assert openai.OpenAI(base_url=locked.url + "/v1", api_key="sekret").models.list().data


def test_max_queued_requests_and_stream_interval(locked):
    auth = {"Authorization": "Bearer sekret"}
    body = {
        "text": "Tell a long story.",
        "stream": True,
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
    }
    with httpx.Client(base_url=locked.url, timeout=120, headers=auth) as c:
        chunks = sse_events(c.post("/generate", json=body).iter_lines())[:-1]
        counts = [e["meta_info"]["completion_tokens"] for e in chunks]
        assert counts[0] >= 1 and counts[-1] == 30 and all(b - a >= 4 for a, b in zip(counts[1:-1], counts[2:-1]))
        assert len(chunks) <= 2 + 30 // 4
        statuses, lock = [], threading.Lock()

        def one():
            with httpx.Client(base_url=locked.url, timeout=120, headers=auth) as cc:
                r = cc.post(
                    "/generate",
                    json={
                        **body,
                        "stream": False,
                        "sampling_params": {**body["sampling_params"], "max_new_tokens": 16},
                    },
                )
                with lock:
                    statuses.append((r.status_code, r.headers.get("retry-after")))

        threads = [threading.Thread(target=one) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert (503, "1") in statuses and (200, None) in statuses, statuses


def test_request_timeout_aborts_and_a_stalled_header_closes_the_connection(locked):
    auth = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=locked.url, timeout=120, headers=auth) as c:
        wait_idle(c)  # the queue test's requests have all left (a timed-out one is aborted a moment later)
        t0 = time.monotonic()
        r = c.post(
            "/generate",
            json={
                "text": "Tell a long story.",
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
            },
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert 19 < time.monotonic() - t0 < 45
        deadline = time.monotonic() + 30
        while c.get("/get_server_info").json()["running_requests"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get("/get_server_info").json()["running_requests"] == 0  # the engine aborted it
    host, port = locked.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-")  # and nothing more
        t0 = time.monotonic()
        assert s.recv(100) == b"" and time.monotonic() - t0 < 5  # closed by the server after --header-timeout
