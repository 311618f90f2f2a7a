"""The official `openai` client against the server: completions, chat, streaming, n, logprobs, seeds, stops,
response_format json_schema (outputs validated with jsonschema) and json_object, and errors as the client raises
them."""

import json

import jsonschema
import openai
import pytest

from tests.engine.conftest import PROMPTS


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_models(oai, client):
    models = oai.models.list().data
    assert len(models) == 1 and models[0].id == client.get("/get_model_info").json()["served_model_name"]


def test_completion_equals_generate_and_streams_the_same_text(oai, model, client):
    native = client.post(
        "/generate", json={"text": PROMPTS[10], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ).json()
    out = oai.completions.create(model=model, prompt=PROMPTS[10], max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.model == model
    assert out.choices[0].text == native["text"] and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"] and out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10

    chunks = list(
        oai.completions.create(
            model=model,
            prompt=PROMPTS[10],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == native["text"]
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completion_batch_n_logprobs_and_echo(oai, model):
    out = oai.completions.create(
        model=model, prompt=[PROMPTS[11], PROMPTS[12]], max_tokens=4, n=2, logprobs=3, temperature=0.7, seed=5
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
        assert "".join(lp.tokens) == c.text
        assert all(
            0 < len(top) <= 3 and max(top.values()) >= lp_ - 1e-5
            for top, lp_ in zip(lp.top_logprobs, lp.token_logprobs)
        )
    again = oai.completions.create(
        model=model, prompt=[PROMPTS[11], PROMPTS[12]], max_tokens=4, n=2, logprobs=3, temperature=0.7, seed=5
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    scored = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "The capital of France is" and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == "The capital of France is" and all(x < 0 for x in lp.token_logprobs[1:])


def test_chat_stream_n_equals_non_stream(oai, model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    kw = dict(model=model, messages=messages, max_tokens=8, temperature=0.9, seed=3, n=2)
    out = oai.chat.completions.create(**kw)
    assert out.object == "chat.completion" and [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in out.choices)
    texts, roles, reasons = {0: "", 1: ""}, {}, {}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            assert c.index not in reasons  # nothing after a choice's final chunk
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"} and set(reasons) == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in out.choices]
    assert [reasons[0], reasons[1]] == [c.finish_reason for c in out.choices]


def test_chat_ends_at_eos_and_stop_strings(oai, model):
    out = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=16, temperature=0
    )
    assert out.choices[0].finish_reason == "stop" and "<|im_end|>" not in out.choices[0].message.content
    text = oai.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0).choices[0].text
    assert " 5," in text
    stopped = oai.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5,"])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.index(" 5,")]


def test_chat_logprobs(oai, model):
    out = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy: the chosen token is the top one


def test_response_format_json_schema(oai, model):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "population": {"type": "integer", "minimum": 0},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
    }
    out = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    streamed = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content


def test_response_format_json_object(oai, model):
    # JSON mode: any object, containers nested at most FREE_DEPTH deep; the answer must parse as a JSON object.
    out = oai.chat.completions.create(
        model=model,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Output a JSON object with the keys name and age for Alice, who is 30."}],
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value, dict) and "name" in value, value


def test_logit_bias(oai, model):
    # OpenAI's keys are token ids as strings; +100 forces a token (banning with -100: tests/engine/test_engine.py).
    out = oai.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logit_bias={"42": 100}, logprobs=0
    )
    tokens = out.choices[0].logprobs.tokens
    assert out.usage.completion_tokens == 3 and len(set(tokens)) == 1 and out.choices[0].text == "".join(tokens)
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    assert chat.choices[0].message.content == out.choices[0].text


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=5000), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(n=0), "n"),
        (dict(top_logprobs=2), "top_logprobs"),
        (
            dict(extra_body={"lora_path": "adapter"}),
            "lora_path",
        ),  # an adapter on a server without --enable-lora (unknown
        # keys are ignored, as upstream does: tests/server/test_dropin.py)
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (dict(extra_body={"regex": "(unclosed"}), "regex"),
        (dict(logit_bias={"1": 500}), "logit_bias"),
        (dict(logit_bias={str(10**7): 5}), "logit_bias"),  # past the vocabulary: found by the engine
    ],
)
def test_errors_name_the_field(oai, model, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], **kwargs)
    err = e.value.body  # the client's view of the body's "error" object
    assert e.value.status_code == 400 and err["message"].startswith(field + ":"), err
    assert err["param"].startswith(field.split(".")[0]) and err["type"] == "invalid_request_error"
