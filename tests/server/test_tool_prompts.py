"""Tools in the prompt (through the model's own chat template) and the constraint grammar of each tool_choice,
without a server: SmolLM2's ChatML template, a template that reads `tools` as Qwen2.5's does, the built-in
Llama-3 template with the llama3 format."""

import json
import re

import pytest

from sgjax.fsm import from_tokenizer
from sgjax.fsm.grammar import compile_grammar
from sgjax.model.chat_templates import LLAMA3
from sgjax.model.tokenizer import _compile_template
from sgjax.server import tools
from sgjax.server.protocol import ApiError, ChatCompletionRequest
from sgjax.server.tool_parsers import default_parser_name, get_parser
from sgjax.server.tools import template_input

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: the arguments are {}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [("get_weather", '{"city": "Paris"}')]},
    {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
]
# Written for this test in the way Qwen2.5's template reads tools: the tool list, each call's arguments as an object
# (tojson), tool results in <tool_response> tags.
QWEN_LIKE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}<|im_start|>assistant
"""


def _req(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw}, strict=True)


def _render(template, fmt, choice="auto"):
    plan = tools.plan(_req(tools=[WEATHER], tool_choice=choice), fmt)
    messages, extra = template_input(HISTORY, plan, fmt, template)
    return _compile_template(template).render(messages=messages, add_generation_prompt=True, **extra)


def test_smollm2_chatml_gets_tools_in_a_system_message(smollm2_tokenizer):
    text = _render(smollm2_tokenizer.chat_template, get_parser("hermes"))
    assert text.startswith("<|im_start|>system\n# Tools")  # ours replaces SmolLM2's default system prompt
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    none = _render(smollm2_tokenizer.chat_template, get_parser("hermes"), "none")
    assert "# Tools" not in none  # tool_choice none: the tools stay out of the prompt


def test_a_template_that_reads_tools_gets_them_natively():
    text = _render(QWEN_LIKE, get_parser("qwen25"))
    assert text.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # an object, not a JSON string in JSON
    assert "# Tools" not in text and "<tool_response>\n18 C\n</tool_response>" in text


def test_llama3_template_with_the_llama3_format():
    text = _render(LLAMA3, get_parser("llama3"))
    assert "<|start_header_id|>system<|end_header_id|>\n\n# Tools" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "pythonic"])
def test_each_choice_grammar(fmt, smollm2_tokenizer):
    parser = get_parser(fmt)
    vocab = from_tokenizer(smollm2_tokenizer)
    one = parser.render([("get_weather", '{"city": "Paris"}')])
    two = parser.render([("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    bad = parser.render([("get_weather", '{"city": 5}')])
    for choice, accepts, refuses in [
        ("required", [one, two], ["hello", bad]),
        ({"type": "function", "function": {"name": "get_time"}}, [parser.render([("get_time", "{}")])], [one]),
        ("auto", [one, two, "Hello there.", ""], [bad]),
    ] + (
        [
            (
                "auto",
                ["Let me check.\n" + one, "x < y, [TOOL] <tool", "Sure. " + one + " Done.", one + "\nok " + two],
                ["Sure. " + bad, one + " Done. " + bad, one + " then " + parser.trigger + " no call"],
            )
        ]
        if parser.trigger
        else [("auto", [], [one + " Done."])]
    ):  # calls that open the answer are all of it
        plan = tools.plan(_req(tools=[WEATHER, CLOCK], tool_choice=choice), parser)
        grammar = compile_grammar(plan.regex, vocab)
        for text in accepts:
            assert grammar.is_accepting(grammar.walk(smollm2_tokenizer.encode(text))) or text == "", (choice, text)
        for text in refuses:
            state = grammar.walk(smollm2_tokenizer.encode(text))
            assert state < 0 or not grammar.is_accepting(state), (choice, text)
        for text in accepts:
            scan = parser.scan(text)
            assert all(json.loads(c.arguments) is not None for c in scan.calls)
    single = tools.plan(_req(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False), parser)
    assert re.fullmatch(single.regex, one) and not re.fullmatch(single.regex, two)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_text_after_calls(fmt):
    """SGLang's structural tags: after a call, free text again; the trigger opens another call only with parallel
    calls, and the text around calls is the content."""
    parser = get_parser(fmt)
    one, two = parser.render([("get_weather", '{"city": "Paris"}')]), parser.render([("get_time", "{}")])
    parallel = tools.plan(_req(tools=[WEATHER, CLOCK]), parser).regex
    single = tools.plan(_req(tools=[WEATHER, CLOCK], parallel_tool_calls=False), parser).regex
    text = f"Checking. {one} It is 18 C. {two} Done."
    assert re.fullmatch(parallel, text) and not re.fullmatch(single, text)
    assert re.fullmatch(single, f"Checking. {one} It is 18 C.")
    assert not re.fullmatch(single, f"{one} then {parser.trigger}")  # the text after the one call: no trigger
    scan = parser.scan(text)
    assert [c.name for c in scan.calls] == ["get_weather", "get_time"]
    assert " ".join(scan.content.split()) == "Checking. It is 18 C. Done."


# -- pythonic: keyword arguments of Python literals (fsm/python_literal.py) ----------------------------------------
RICH = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["eur", "usd"]},
                "late": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
                "ages": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
                "room": {
                    "type": "object",
                    "properties": {"beds": {"type": "integer"}, "view": {"type": "boolean"}},
                    "required": ["beds"],
                },
            },
            "required": ["city", "nights"],
        },
    },
}
DOTTED = {"type": "function", "function": {"name": "math.now"}}
PY_GOOD = [
    '[book(city="Paris", nights=2)]',
    (
        '[book(city="Pa\\"ris", nights=14, unit="usd", late=True, note=None, ages=[1.5, -2, 3e2], '
        'room={"beds": 2, "view": False})]'
    ),
    "[math.now()]",
    '[book(city="", nights=1), math.now()]',
    '[book(city="Nice", nights=3, note="x\\n")]',
]
PY_BAD = [
    "[book(nights=2)]",
    '[book(city="Paris")]',
    '[book(city="Paris", nights=0)]',  # required, bounds
    '[book(city="Marseille", nights=2)]',
    "[book(city='Paris', nights=2)]",  # maxLength, the one quote
    '[book(city="Paris", nights=2, unit="gbp")]',
    '[book(city="Paris", nights=2, late=true)]',
    '[book(nights=2, city="Paris")]',
    '[book(city="a\\/b", nights=1)]',
    '[book(city="P", nights=1, room={})]',
    '[book("Paris", 2)]',
    "book(city='x', nights=1)",
    "[]",
    '[book(city="P", nights=1)] ok',
]


def _py_plan(choice="required", **kw):
    return tools.plan(_req(tools=[RICH, DOTTED], tool_choice=choice, **kw), get_parser("pythonic"))


def _valid_calls(parser, text) -> list:
    import jsonschema

    specs = {t["function"]["name"]: t["function"].get("parameters", tools._NO_PARAMS) for t in (RICH, DOTTED)}
    scan = parser.scan(text)
    for c in scan.calls:
        jsonschema.validate(json.loads(c.arguments), specs[c.name])
    return list(scan.calls)


def test_pythonic_grammar_accepts_and_refuses(smollm2_tokenizer):
    parser, plan = get_parser("pythonic"), _py_plan()
    grammar = compile_grammar(plan.regex, from_tokenizer(smollm2_tokenizer))
    for text in PY_GOOD:
        assert re.fullmatch(plan.regex, text), text
        assert grammar.is_accepting(grammar.walk(smollm2_tokenizer.encode(text))), text
        assert _valid_calls(parser, text), text  # the existing parser reads it, and it validates
    for text in PY_BAD:
        assert not re.fullmatch(plan.regex, text), text
    named = _py_plan({"type": "function", "function": {"name": "math.now"}})
    assert re.fullmatch(named.regex, "[math.now()]") and not re.fullmatch(named.regex, PY_GOOD[0])
    single = _py_plan(parallel_tool_calls=False)
    assert re.fullmatch(single.regex, PY_GOOD[0]) and not re.fullmatch(single.regex, PY_GOOD[3])
    auto = _py_plan("auto")  # an answer opening with `[` is calls; any other first character starts free text
    for text in PY_GOOD + ["Sure, Paris.", "", "(1, 2)"]:
        assert re.fullmatch(auto.regex, text), text
    assert not re.fullmatch(auto.regex, "[1, 2, 3] is a list") and not re.fullmatch(auto.regex, PY_BAD[0])
    # The prompt's history writes calls as the grammar spells them (double quotes, True / None).
    assert re.fullmatch(plan.regex, parser.render([("book", '{"city": "Nice", "nights": 1, "late": false}')]))


def test_pythonic_random_walks_parse_and_validate():
    import numpy as np

    from sgjax.fsm.automaton import compile_regex

    parser, plan = get_parser("pythonic"), _py_plan()
    dfa, rng, done = compile_regex(plan.regex), np.random.default_rng(0), 0
    for _ in range(200):
        state, out = 0, bytearray()
        for _ in range(600):
            nxt = dfa.out_bytes(state)
            if dfa.accepting[state] and (not nxt or rng.random() < 0.1):
                text = bytes(out).decode()
                assert _valid_calls(parser, text), text
                done += 1
                break
            out.append(int(rng.choice(nxt)))
            state = dfa.step(state, bytes(out[-1:]))
    assert done >= 150


def test_pythonic_refusals_name_the_field():
    def refused(tool, field):
        with pytest.raises(ApiError) as e:
            tools.plan(_req(tools=[tool], tool_choice="required"), get_parser("pythonic"))
        assert e.value.param == field, e.value

    params = {"type": "object", "properties": {"from": {"type": "string"}}}  # a keyword is not an argument name
    refused({"type": "function", "function": {"name": "f", "parameters": params}}, "tools.0.function.parameters")
    refused({"type": "function", "function": {"name": "get-time"}}, "tools.0.function.name")  # not a Python name
    anyof = {"anyOf": [{"type": "object"}, {"type": "null"}]}
    refused({"type": "function", "function": {"name": "f", "parameters": anyof}}, "tools.0.function.parameters")
    free = tools.plan(_req(tools=[WEATHER], tool_choice="required"), get_parser("hermes"), constrain=False)
    assert free.regex is None


# -- reasoning before constrained calls ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["hermes", "pythonic"])
def test_reasoning_block_before_constrained_calls(fmt, smollm2_tokenizer):
    """With a reasoning parser the grammar lets the model think first (free text without `</think>`, then
    `</think>`), then holds it to the calls; the answer's split then finds valid calls in the content."""
    from sgjax.server.chat_output import ChatOutput
    from sgjax.server.reasoning import ReasoningParser

    parser, vocab = get_parser(fmt), from_tokenizer(smollm2_tokenizer)
    one = parser.render([("get_weather", '{"city": "Paris"}')])
    bad = parser.render([("get_weather", '{"city": 5}')])
    forced, optional = ReasoningParser.named("deepseek-r1"), ReasoningParser.named("qwen3")
    cases = [
        (
            forced,
            "required",
            [
                "<think>Paris, so get_weather.</think>\n\n" + one,
                "No opening tag.</think>" + one,
                "</think>" + one,
                "<think>mentions <tool_call> and [f(x=1)] freely</think>\n" + one,
            ],
            [
                one,
                "<think>never closed " + one,
                "<think>a</think>b</think>" + one,
                "<think>x</think> Sure. " + one,
                "<think>x</think>" + bad,
            ],
        ),
        (optional, "required", [one, "<think>hm</think>\n" + one], ["I think.</think>" + one, "<think>x</think>hi"]),
        (
            forced,
            {"type": "function", "function": {"name": "get_weather"}},
            ["<think>ok</think>" + one],
            ["<think>ok</think>" + parser.render([("get_time", "{}")])],
        ),
    ] + (
        [
            (forced, "auto", ["<think>a <tool_call> in thought</think>Sure. " + one + " Done."], ["Sure. " + one]),
            # an optional type under auto: the free text holds the block, which then may not write the trigger
            (
                optional,
                "auto",
                ["<think>hm</think>Sure. " + one, "Sure. " + one],
                ["<think>a <tool_call> b</think>" + one],
            ),
        ]
        if parser.trigger
        else []
    )
    for reasoning, choice, accepts, refuses in cases:
        plan = tools.plan(_req(tools=[WEATHER, CLOCK], tool_choice=choice), parser, reasoning=reasoning)
        grammar = compile_grammar(plan.regex, vocab)
        for text in accepts:
            assert re.fullmatch(plan.regex, text), (choice, text)
            assert grammar.is_accepting(grammar.walk(smollm2_tokenizer.encode(text))), (choice, text)
            msg, called = ChatOutput(tools=parser, reasoning=reasoning).message(text)
            assert called and msg["tool_calls"][0]["function"]["name"] == "get_weather", (text, msg)
            assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        for text in refuses:
            assert not re.fullmatch(plan.regex, text), (choice, text)


# -- a real Qwen template with tools -------------------------------------------------------------------------------
def _installed_qwen_template():
    """The Qwen chat template with tools that the installed bfcl_eval carries (the docstring of its Qwen FC handler's
    `_format_prompt`: Qwen3's template, whose tool section is Qwen2.5's), and that method itself, BFCL's hand-written
    rendering of the same template. Read from the installed file, not copied here."""
    import ast
    import importlib.util
    import inspect
    import os

    spec = importlib.util.find_spec("bfcl_eval")  # installed by `make setup` (the BFCL tests' data)
    assert spec is not None, "bfcl_eval is missing: make setup installs it"
    path = os.path.join(spec.submodule_search_locations[0], "model_handler", "local_inference", "qwen_fc.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "_format_prompt")
    # The docstring's source text: its `\\n` and `\\"` are the template's own escapes, which Python's reading of the
    # string would turn into characters.
    raw = ast.get_source_segment(source, fn.body[0].value).strip('"')
    template = inspect.cleandoc(raw).split('"chat_template":', 1)[1].strip()
    fn.decorator_list = []
    namespace = {"json": json}
    exec(compile(ast.Module([fn], []), path, "exec"), namespace)  # noqa: S102 - the installed package's own code
    return template, namespace["_format_prompt"]


def test_real_qwen_template_renders_tools_calls_and_results():
    template, bfcl_render = _installed_qwen_template()
    assert "<tool_call>" in template and "tools" in template
    fmt = get_parser("qwen25")
    assert default_parser_name(template) == "hermes"
    plan = tools.plan(_req(tools=[WEATHER, CLOCK]), fmt)
    messages, extra = template_input(HISTORY, plan, fmt, template)
    text = _compile_template(template).render(messages=messages, add_generation_prompt=True, **extra)
    assert text == bfcl_render(None, messages, extra["tools"])  # the template and BFCL's rendering of it agree
    listing = "\n".join(json.dumps(t) for t in extra["tools"])
    assert text.startswith("<|im_start|>system\n# Tools\n\n") and f"<tools>\n{listing}\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text  # the arguments as an object, tojson'ed by the template
    assert text.endswith("<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # What the template shows the model is what the parser reads and the grammar forces.
    (call,) = fmt.scan(text).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert re.fullmatch(plan.regex, fmt.render([("get_weather", '{"city": "Paris"}')]))
