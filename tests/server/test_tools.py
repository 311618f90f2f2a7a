"""Tool calling and reasoning on /v1/chat/completions against a real `sgjax serve` (SmolLM2): the official openai
client, LangChain and litellm; BFCL function specs whose constrained calls must all parse and validate; streamed
tool-call deltas that concatenate to the whole answer's calls; the reasoning split on a real run."""

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import textwrap

import httpx
import jsonschema
import openai
import pytest

from sgjax.data import bfcl, bfcl_ast_match
from tests.server.conftest import SMALL_FLAGS, assert_no_leak, serving, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tool_server():
    # hermes named explicitly (the default for SmolLM2's template too); qwen3's reasoning format is optional, so
    # answers without <think> stay content.
    yield from serving(*SMALL_FLAGS, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _valid(call, tools) -> dict:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec["parameters"])
    return args


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_constrained_call(oai, choice):
    r = oai.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if choice is NAMED:
        assert call.function.name == "get_weather"
    _valid(call, [WEATHER, TIME])


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_every_call_parses_within_the_token_budget(oai, choice):
    """Constrained calls know their budget (fsm/completion.py): with max_tokens from 8 to 128 and parallel calls
    allowed, over seeded sampling, every returned call parses and validates against its schema, and a budget that
    can hold the grammar's shortest answer always ends in whole calls ("tool_calls"); a smaller one ends with
    finish_reason "length", returning no call made up from the cut text."""
    seen_length = seen_calls = 0
    for max_tokens in (8, 12, 16, 24, 32, 48, 64, 96, 128):
        for seed in range(3):
            r = oai.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Weather and time in Paris, Tokyo, Lima and Oslo, please."}],
                tools=[WEATHER, TIME],
                tool_choice=choice,
                max_tokens=max_tokens,
                temperature=1.0,
                seed=seed,
            )
            choice0 = r.choices[0]
            calls = choice0.message.tool_calls or []
            for call in calls:
                _valid(call, [WEATHER, TIME])
            seen_calls += len(calls)
            if choice0.finish_reason == "length":
                # too small a budget for the whole grammar: the calls whose JSON closed before the cut (validated
                # above), and otherwise the cut text itself, never a call made up from it
                seen_length += 1
                assert calls or choice0.message.content, (max_tokens, seed, choice0)
            else:
                assert choice0.finish_reason == "tool_calls" and calls, (max_tokens, seed, choice0)
    assert seen_calls > 0 and seen_length > 0  # both sides of the rule were exercised


def test_none_and_auto(oai):
    r = oai.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # auto: the model answers in text or calls; either way the answer has the OpenAI shape and any call is valid.
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _valid(c.message.tool_calls[0], [WEATHER])
    else:  # text; a finished one never writes the trigger outside a call (the grammar's text part)
        assert c.message.content and (c.finish_reason == "length" or "<tool_call>" not in c.message.content)


def test_stream_deltas_concatenate_to_the_call(oai):
    kw = dict(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        temperature=0,
    )
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, reasons = {}, []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # a call's first delta: id, type and name (OpenAI's shape)
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    assert d.function.name is None
                    calls[d.index][1] += d.function.arguments
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [tuple(v) for _, v in sorted(calls.items())] == [(c.function.name, c.function.arguments) for c in whole]
    assert len(whole) == 1


def test_history_with_tool_calls_and_results(oai):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    r = oai.chat.completions.create(
        model="m", messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8, temperature=0
    )
    assert r.choices[0].message.content
    # The calls and results reach the prompt in the format the model was given (hermes blocks, tool responses).
    base = str(oai.base_url).removesuffix("/v1/")
    ids = httpx.post(base + "/tokenize", json={"messages": history}, timeout=60).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=60).json()["text"]
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text


def test_refusals_name_the_field(tool_server):
    url = tool_server.url + "/v1/chat/completions"
    cases = [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "string", "not": {}}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": [WEATHER], "tool_choice": "required", "regex": "a+"}, "regex"),
        ({"tools": [WEATHER], "tool_choice": "required", "ebnf": "root ::= 'a'"}, "ebnf"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0.tool_calls",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ]
    for extra, field in cases:
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == field, (extra, r.json())


def test_bfcl_constrained_calls_all_validate(oai, tool_server):
    """24 BFCL function specs, each with its function named: every call must parse and validate against its schema
    (the grammar's promise); the AST-match accuracy is the model's (printed, not a gate). 24, not 50: on a slow
    2-core CPU 50 took 215 s of the suite."""
    tasks = bfcl("simple_python")[:24]

    def one(task):
        tools = [_short(t) for t in task["tools"]]
        # separate_reasoning false: the calls' grammar alone, without the server's optional <think> block before it
        # (test_forced_reasoning_then_valid_calls covers that; 50 grammars with it took 118 s against 75 in CI)
        r = oai.chat.completions.create(
            model="m",
            messages=task["messages"],
            tools=tools,
            max_tokens=160,
            temperature=0,
            parallel_tool_calls=False,
            extra_body={"separate_reasoning": False},
            tool_choice={"type": "function", "function": {"name": tools[0]["function"]["name"]}},
        )
        (call,) = r.choices[0].message.tool_calls
        return bfcl_ast_match(call.function.name, _valid(call, tools), task["ground_truth"])

    with cf.ThreadPoolExecutor(8) as pool:
        matches = list(pool.map(one, tasks))
    print(f"\nBFCL simple_python[:24], named tool_choice: 24/24 valid, AST accuracy {sum(matches) / 24:.2f}")
    assert_no_leak(httpx.Client(base_url=tool_server.url, timeout=60))


def _short(tool: dict) -> dict:
    """A BFCL tool without descriptions (shorter prompts on CPU) and with bounded strings and arrays: a looping small
    model then still closes its call within max_tokens (a grammar cannot make a cut-off call valid)."""

    def bound(s):
        if not isinstance(s, dict):
            return s
        s = {
            k: ({p: bound(v) for p, v in s["properties"].items()} if k == "properties" else bound(v))
            for k, v in s.items()
            if k != "description"
        }
        if s.get("type") == "string" and "enum" not in s:
            s.setdefault("maxLength", 12)
        if s.get("type") == "array":
            s.setdefault("maxItems", 2)
        return s

    f = tool["function"]
    return {**tool, "function": {"name": f["name"], "parameters": bound(f["parameters"])}}


def test_langchain_bind_tools_round_trip(tool_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"18 C and sunny in {city}"

    llm = ChatOpenAI(
        base_url=tool_server.url + "/v1", api_key="none", model="m", temperature=0, max_tokens=48, max_retries=0
    )
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([HumanMessage("Weather in Paris?")])
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = llm.bind_tools([get_weather]).invoke([HumanMessage("Weather in Paris?"), ai, result])
    assert answer.content or answer.tool_calls

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)

    got = llm.with_structured_output(Person, method="function_calling").invoke("Alice is 30 years old.")
    assert isinstance(got, Person)


def test_litellm_tools(tool_server):
    # litellm is heavy to import and reaches for its price list online: a child process, with the bundled list.
    script = textwrap.dedent(f"""
        import json, litellm
        r = litellm.completion(model="openai/m", api_base={tool_server.url + "/v1"!r}, api_key="none",
                               messages={ASK!r}, tools=[{json.dumps(WEATHER)}], tool_choice="required",
                               parallel_tool_calls=False, max_tokens=48, temperature=0)
        c = r.choices[0]
        print(json.dumps({{"finish": c.finish_reason, "name": c.message.tool_calls[0].function.name,
                           "args": c.message.tool_calls[0].function.arguments}}))
    """)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["finish"] == "tool_calls" and got["name"] == "get_weather"
    jsonschema.validate(json.loads(got["args"]), WEATHER["function"]["parameters"])


# -- reasoning ----------------------------------------------------------------------------------------------------
THINK = r"<think>[a-z ]{4,30}</think>\n\n[A-Za-z ]{1,24}"  # a forced reasoning block on a model that never thinks


def test_reasoning_split_on_a_real_run(oai, tool_server):
    kw = dict(model="m", messages=ASK, max_tokens=40, temperature=0, extra_body={"regex": THINK})
    msg = oai.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content and msg.content
    assert "<think>" not in msg.content and "</think>" not in msg.reasoning_content
    streamed = {"reasoning_content": "", "content": ""}
    with httpx.stream(
        "POST",
        tool_server.url + "/v1/chat/completions",
        json={**kw, **kw.pop("extra_body"), "stream": True},
        timeout=120,
    ) as r:
        for e in sse_events(r.iter_lines()):
            if e != "[DONE]":
                for key, value in e["choices"][0]["delta"].items():
                    if key in streamed and value:
                        streamed[key] += value
    assert streamed == {"reasoning_content": msg.reasoning_content, "content": msg.content}
    # stream_reasoning false (SGLang's field): the reasoning arrives once, whole, before the content
    order = []
    with httpx.stream(
        "POST",
        tool_server.url + "/v1/chat/completions",
        json={**kw, "regex": THINK, "stream": True, "stream_reasoning": False},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        for e in sse_events(r.iter_lines()):
            if e != "[DONE]":
                order += [(k, v) for k, v in e["choices"][0]["delta"].items() if k in streamed and v]
    assert order[0] == ("reasoning_content", msg.reasoning_content)
    assert [k for k, _ in order].count("reasoning_content") == 1
    assert "".join(v for k, v in order if k == "content") == msg.content
    # separate_reasoning false (SGLang's switch): the block stays in the content
    kept = (
        oai.chat.completions.create(
            model="m",
            messages=ASK,
            max_tokens=40,
            temperature=0,
            extra_body={"regex": THINK, "separate_reasoning": False},
        )
        .choices[0]
        .message
    )
    assert kept.content.startswith("<think>") and getattr(kept, "reasoning_content", None) is None


# -- EBNF -----------------------------------------------------------------------------------------------------
def test_ebnf_over_http(oai, tool_server):
    from lark import Lark

    from sgjax.fsm.automaton import compile_regex
    from sgjax.fsm.ebnf import ebnf_to_regex
    from tests.fsm.test_ebnf import GRAMMARS

    ebnf, lark_src = GRAMMARS["arithmetic"]
    r = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write a sum."}],
        max_tokens=16,
        temperature=0,
        extra_body={"ebnf": ebnf},
    )
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        Lark(lark_src, parser="earley", lexer="dynamic").parse(text)
    else:  # cut off by max_tokens: still a prefix of the grammar's strings
        assert compile_regex(ebnf_to_regex(ebnf)).step(0, text.encode()) >= 0, text
    bad = "root ::= undefined_rule"
    for route, body, field in [
        ("/v1/chat/completions", {"messages": ASK, "ebnf": bad}, "ebnf"),
        ("/generate", {"text": "Hi", "sampling_params": {"ebnf": bad}}, "sampling_params.ebnf"),
        (
            "/generate",
            {"text": "Hi", "sampling_params": {"ebnf": "root ::= 'a'", "regex": "a"}},
            "sampling_params.regex",
        ),
    ]:
        got = httpx.post(tool_server.url + route, json={**body, "max_tokens": 4}, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
        assert ("undefined_rule" if "undefined" in json.dumps(body) else "mutually exclusive") in got.text


def test_structural_tag_over_http(oai, tool_server):
    tag = {
        "type": "structural_tag",
        "triggers": ["<f="],
        "structures": [
            {
                "begin": "<f=add>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                "end": "</f>",
            }
        ],
    }
    r = oai.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0, response_format=tag)
    from sgjax.fsm.automaton import compile_regex
    from sgjax.fsm.structural_tag import structural_tag_to_regex

    spec = {k: tag[k] for k in ("structures", "triggers")}
    text = r.choices[0].message.content
    assert text and compile_regex(structural_tag_to_regex(spec)).step(0, text.encode()) >= 0, text
    bad = {**tag, "triggers": ["<a", "<b"]}
    got = httpx.post(
        tool_server.url + "/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 4, "response_format": bad},
        timeout=60,
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == "response_format", got.text
    got = httpx.post(
        tool_server.url + "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "structural_tag": json.dumps(bad)}},
        timeout=60,
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == "sampling_params.structural_tag", got.text


# -- a pythonic server with a forced reasoning type ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pythonic_server():
    # deepseek-r1 is a forced type: every constrained answer opens with the reasoning block (or drops it with
    # separate_reasoning false); pythonic calls are Python, held to the same grammar guarantees as JSON ones.
    yield from serving(*SMALL_FLAGS, "--tool-call-parser", "pythonic", "--reasoning-parser", "deepseek-r1")


@pytest.fixture(scope="module")
def py_oai(pythonic_server):
    return openai.OpenAI(base_url=pythonic_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _finished_calls_validate(choices, tools) -> int:
    """Every answer that finished calls and every call validates; returns how many finished."""
    done = [c for c in choices if c.finish_reason != "length"]
    for c in done:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            _valid(call, tools)
    return len(done)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_pythonic_calls_on_a_real_run(py_oai, choice):
    r = py_oai.chat.completions.create(
        model="m",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        n=4,
        max_tokens=48,
        temperature=0.8,
        seed=3,
        extra_body={"separate_reasoning": False},
    )  # no reasoning block: calls only
    assert _finished_calls_validate(r.choices, [WEATHER, TIME]) == 4
    if isinstance(choice, dict):
        assert {c.message.tool_calls[0].function.name for c in r.choices} == {"get_time"}


# SmolLM2 never thinks by itself; two earlier turns that reasoned before calling show it how.
SHOTS = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": "<think>The weather tool answers this.</think>",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C in Rome."},
    {"role": "user", "content": "What time is it in Tokyo?"},
    {
        "role": "assistant",
        "content": "<think>The time tool answers this.</think>",
        "tool_calls": [
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "09:12"},
    {"role": "assistant", "content": "It is 09:12 in Tokyo."},
]


def test_forced_reasoning_then_valid_calls(py_oai):
    """The grammar lets the model reason (free text up to `</think>`) and then holds it to the calls: every
    finished answer has its reasoning split off and valid calls in the content."""
    r = py_oai.chat.completions.create(
        model="m",
        messages=SHOTS + ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        n=4,
        max_tokens=96,
        temperature=0.7,
        seed=1,
    )
    assert _finished_calls_validate(r.choices, [WEATHER, TIME]) >= 1
    for c in r.choices:
        if c.finish_reason != "length":
            assert c.message.reasoning_content and "</think>" not in c.message.reasoning_content
            assert not c.message.content  # the content was the calls
