"""Bad requests get a 4xx whose JSON message names the field, the engine keeps serving, nothing leaks; fuzzed bodies
never get a 5xx."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import assert_no_leak

HI = {"role": "user", "content": "Hi"}
LONG = list(range(100, 4200))  # past the 4096-token pool


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ("/generate", {"text": "hi", "sampling_params": {"nucleus": 0.5}}, "sampling_params.nucleus"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "sampling_params.max_new_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "sampling_params.regex"),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"json_schema": {"type": "object", "not": {}}}},
            "sampling_params.json_schema",
        ),
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": {"anyOf": 3}}}, "sampling_params.json_schema"),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"json_schema": {"type": "object", "properties": []}}},
            "sampling_params.json_schema",
        ),
        (
            "/generate",
            {"text": "hi", "sampling_params": {"json_schema": {"type": "integer", "minimum": "a"}}},
            "sampling_params.json_schema",
        ),
        ("/generate", {"text": "hi", "sampling_params": [{}, {}]}, "sampling_params"),
        ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"top_k": 0}]}, "sampling_params.1.top_k"),
        ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
        ("/generate", {"text": 5}, "text"),
        ("/generate", {"text": ""}, "text"),
        ("/generate", {"text": []}, "text"),
        ("/generate", {}, "text"),
        ("/generate", {"text": "hi", "input_ids": [1]}, "text"),
        ("/generate", {"input_ids": [1, -3]}, "input_ids"),
        ("/generate", {"input_ids": [1, 1.5]}, "input_ids"),
        ("/generate", {"input_ids": LONG}, "input_ids"),
        ("/generate", {"text": "hi", "rid": ["a", "b"]}, "rid"),
        ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
        ("/generate", {"text": "hi", "top_logprobs_num": 1000}, "top_logprobs_num"),
        ("/generate", {"text": ["hi", "ho"], "sampling_params": {"n": 600}}, "text"),  # 1200 generations: over the cap
        ("/generate", {"text": "hi", "sampling_params": {"n": 5000}}, "sampling_params.n"),
        ("/generate", {"text": "hi", "image_data": "x"}, "image_data"),
        ("/generate", {"text": "hi", "bootstrap_room": 7}, "bootstrap_host"),  # PD: a room without its worker
        (
            "/generate",
            {"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": [1, 2, 3]},
            "bootstrap_room",
        ),
        ("/v1/completions", {"model": "m", "prompt": "hi", "bootstrap_room": 7}, "bootstrap_host"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": LONG}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "stop": [1]}, "stop"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": "hot"}, "temperature"),
        (
            "/v1/completions",
            {"model": "m", "prompt": "hi", "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0.image_url",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages.0.content.0",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [  # SmolLM2 is text-only
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                        ],
                    }
                ],
            },
            "messages.0.content.0.image_url.url",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [HI], "max_completion_tokens": 10**6},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": [HI], "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": [HI], "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"model": "m", "messages": [HI], "n": 129}, "n"),
        ("/v1/chat/completions", {"model": "m", "messages": [HI], "seed": 1.5}, "seed"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [HI], "response_format": {"type": "json_schema"}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": [HI],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": 5}}},
            },
            "response_format.json_schema.schema",
        ),
        ("/abort_request", {}, "rid"),
    ],
)
def test_bad_requests_name_the_field(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    head = err["message"].split(":")[0]  # the field's path, e.g. input_ids.1
    assert head == field or head.startswith(field + "."), err["message"]
    assert err["code"] is None and err["type"] == "invalid_request_error"  # OpenAI: a string code or null


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"text": "hi"', "malformed JSON"),
        (b'{"text": "\xff\xfe"}', "invalid UTF-8"),
        (b'{"text": "\\ud800"}', "lone surrogate"),
        (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', "NaN"),
        (b'{"text": "hi", "sampling_params": {"json_schema": {"type": "integer", "maximum": 1e400}}}', "1e400"),
        (b'["text"]', "JSON object"),
        (b"[" * 100000 + b"]" * 100000, "body"),
        (b"", "malformed JSON"),
    ],
)
def test_bodies_that_are_not_json_objects(client, raw, message):
    for route in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(("body:", "text:")) and message in r.json()["error"]["message"]


def test_a_body_over_the_limit_is_413(client):
    from sgjax.server.protocol import MAX_BODY_BYTES

    r = client.post("/generate", json={"text": "x" * (MAX_BODY_BYTES + 1)})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("body:")


def test_openai_routes_need_a_tokenizer():
    from types import SimpleNamespace

    from sgjax.server.openai_api import need_tokenizer
    from sgjax.server.protocol import ApiError

    with pytest.raises(ApiError, match="skip-tokenizer-init"):
        need_tokenizer(SimpleNamespace(tokenizer=None))


def test_unknown_route_and_method_are_4xx_json(client):
    r = client.get("/nope")
    assert r.status_code == 404 and "/nope" in r.json()["error"]["message"]
    assert client.get("/generate").status_code == 405


def test_the_engine_keeps_serving_after_errors(client):
    for _ in range(3):
        client.post("/generate", json={"text": "hi", "sampling_params": {"regex": "("}})
        client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
    out = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["completion_tokens"] == 2
    assert_no_leak(client)


# -- fuzzing ----------------------------------------------------------------------------------------------------
VALID = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": "m", "messages": [HI], "max_tokens": 2, "temperature": 0},
}
FIELDS = {
    "/generate": [
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
    ],
    "/v1/completions": [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "logprobs",
        "echo",
        "seed",
        "best_of",
        "top_k",
        "min_p",
        "regex",
        "json_schema",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
    ],
    "/v1/chat/completions": [
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "n",
        "stream",
        "stop",
        "logprobs",
        "top_logprobs",
        "response_format",
        "seed",
        "tools",
        "tool_choice",
    ],
}
SAMPLING = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "regex",
    "json_schema",
    "seed",
    "frequency_penalty",
    "ignore_eos",
    "min_new_tokens",
    "skip_special_tokens",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.integers(-3, 40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
# Keys of messages, response formats and JSON schemas too, so nested values reach the template and the schema compiler.
KEYS = SAMPLING + [
    "role",
    "content",
    "type",
    "text",
    "json_schema",
    "schema",
    "properties",
    "items",
    "anyOf",
    "required",
    "enum",
    "maxLength",
    "minimum",
    "$ref",
    "include_usage",
]
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), kids, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def requests(draw):
    route = draw(st.sampled_from(sorted(VALID)))
    if draw(st.integers(0, 9)) == 0:
        return route, draw(st.binary(max_size=40))
    body = json.loads(json.dumps(VALID[route]))
    for _ in range(draw(st.integers(1, 3))):
        nested = isinstance(body.get("sampling_params"), dict) and draw(st.booleans())
        where = body["sampling_params"] if nested else body
        names = SAMPLING if where is not body else FIELDS[route] + ["bogus"]
        key = draw(st.sampled_from(names))
        if draw(st.integers(0, 5)) == 0:
            where.pop(key, None)
        else:
            where[key] = draw(values)
    return route, json.dumps(body).encode()


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=requests())
def test_fuzzed_bodies_never_get_a_5xx(url, req):
    route, raw = req
    try:
        # A body that happens to be valid may generate for long: the client gives up after a second, which
        # disconnects and aborts it (checked below: nothing keeps running, no page leaks).
        r = httpx.post(url + route, content=raw, headers={"content-type": "application/json"}, timeout=1.0)
    except httpx.TimeoutException:
        return
    assert r.status_code < 500, (route, raw, r.text)
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)


def test_after_fuzzing_the_server_is_healthy_and_leaks_nothing(client):
    assert client.get("/health").status_code == 200
    assert_no_leak(client)
    out = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["completion_tokens"] == 2
