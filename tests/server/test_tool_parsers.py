"""The tool-call formats and the reasoning split on hand-made model outputs: whole answers, streams fed one
character at a time (their deltas must concatenate to the whole answer's parse), and malformed text."""

import json

import pytest

from sgjax.server.reasoning import ReasoningParser, ReasoningStream
from sgjax.server.tool_parsers import Stream, ToolCall, default_parser_name, final_content, get_parser

HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
CASES = {
    "hermes": [
        (
            HERMES_TWO,
            "Let me check.",
            [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')],
        ),
        ('<tool_call>\n{"arguments": {"a": "}"}, "name": "f"}\n</tool_call>', "", [("f", '{"a": "}"}')]),
        ("plain answer, no calls", "plain answer, no calls", []),
        ("x < y and <tool_ but no call", "x < y and <tool_ but no call", []),
        # text after the calls (auto's grammar allows it, as SGLang's structural tags do) is content
        (
            HERMES_TWO + "\nDone, both.",
            "Let me check.\n\n\nDone, both.",
            [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')],
        ),
    ],
    "qwen25": [
        (
            HERMES_TWO,
            "Let me check.",
            [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')],
        )
    ],
    "llama3": [
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"s": "p;q}"}}',
            "",
            [("a", '{"x": 1}'), ("b", '{"s": "p;q}"}')],
        ),
        ('{"name": "search", "parameters": {"q": "jax"}}', "", [("search", '{"q": "jax"}')]),
        ("The answer is {42}.", "The answer is {42}.", []),
    ],
    "mistral": [
        (
            'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
            "Sure.",
            [("a", '{"x": 1}'), ("b", "{}")],
        ),
        ("no calls [TOOL here", "no calls [TOOL here", []),
        (
            (
                'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}] Then. '
                '[TOOL_CALLS] [{"name": "b", "arguments": {}}] Done.'
            ),
            "Sure.  Then.  Done.",
            [("a", '{"x": 1}'), ("b", "{}")],
        ),
    ],
    "pythonic": [
        (
            '[get_weather(city="Paris"), set_alarm(at=[7, 30], loud=True)]',
            "",
            [("get_weather", '{"city": "Paris"}'), ("set_alarm", '{"at": [7, 30], "loud": true}')],
        ),
        ("[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ],
}
MALFORMED = [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>',
    "<tool_call>",
    "<tool_call>{{{{",
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    '[TOOL_CALLS] [{"name": ',
    '{"name": "f", "parameters": ',
    "[f(x=)]",
    "[f(*a)]",
    '<|python_tag|>{"x"',
    "\\",
    "<tool_call>\n" + "[" * 2000,
    '"]}' * 50,
    "",
]


def _streamed(parser, text: str, step: int = 1):
    stream, content, calls = Stream(parser), "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] + [""]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls), "a call's first delta names it, in order"
                calls.append([d.name, ""])
            calls[d.index][1] += d.arguments
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", [(f, *case) for f, cases in CASES.items() for case in cases])
def test_parse_and_stream(fmt, text, content, calls):
    parser = get_parser(fmt)
    scan = parser.scan(text)
    assert final_content(scan.content) == content
    assert [(c.name, c.arguments) for c in scan.calls] == calls
    for call in scan.calls:
        json.loads(call.arguments)
    for step in (1, 3, 7):
        assert _streamed(parser, text, step) == (content, calls)


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_never_raises(fmt, text):
    parser = get_parser(fmt)
    scan = parser.scan(text)
    assert all(isinstance(c, ToolCall) for c in scan.calls)
    # Nothing is lost: what is not a call stays in the content.
    if not scan.calls:
        assert scan.content == text
    _streamed(parser, text)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "pythonic"])
def test_render_parses_back(fmt):
    calls = [("get_weather", '{"city": "Paris"}'), ("f", '{"n": [1, 2], "ok": true}')]
    parser = get_parser(fmt)
    scan = parser.scan(parser.render(calls))
    assert [(c.name, json.loads(c.arguments)) for c in scan.calls] == [(n, json.loads(a)) for n, a in calls]
    assert final_content(scan.content) == ""


def test_default_parser_by_template():
    assert default_parser_name("{{ '<|im_start|>' }}") == "hermes"  # SmolLM2's ChatML shows no format
    assert default_parser_name(None) == "hermes"
    assert default_parser_name("{%- if tools %}<tool_call>{% endif %}") == "hermes"
    assert default_parser_name("{{ '<|python_tag|>' }} ipython") == "llama3"
    assert default_parser_name("[TOOL_CALLS]") == "mistral"
    with pytest.raises(ValueError, match="unknown"):
        get_parser("nope")


# -- reasoning ----------------------------------------------------------------------------------------------------
REASONING = [
    # (model type, output, reasoning, content)
    ("qwen3", "<think>I should add.</think>\n\n4", "I should add.", "4"),
    ("qwen3", "Just 4.", "", "Just 4."),
    ("qwen3", "<think>cut off while thinking", "cut off while thinking", ""),
    ("qwen3", "4 <think>not at the start</think>", "", "4 <think>not at the start</think>"),
    ("deepseek-r1", "no opening tag</think>The answer", "no opening tag", "The answer"),
    ("deepseek-r1", "<think>tagged</think>answer", "tagged", "answer"),
    ("deepseek-r1", "still thinking", "still thinking", ""),
]


@pytest.mark.parametrize("model_type,text,reasoning,content", REASONING)
def test_reasoning_split_and_stream(model_type, text, reasoning, content):
    parser = ReasoningParser.named(model_type)
    assert parser.split(text) == (reasoning, content)
    for step, whole in [(1, False), (2, False), (5, False), (1, True), (3, True)]:
        stream, got, pieces_r = ReasoningStream(parser, whole=whole), ["", ""], []
        pieces = [text[i : i + step] for i in range(0, len(text), step)] + [""]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            if r:
                pieces_r.append(r)
                assert not whole or not got[1], "stream_reasoning false: the reasoning comes whole, before content"
            got[0] += r
            got[1] += c
            assert "</think" not in got[0] and not got[1].startswith("<think")
        assert tuple(got) == (reasoning, content)
        if whole:  # one delta, the whole reasoning (at </think>, or at the end of an output cut off while thinking)
            assert pieces_r == ([reasoning] if reasoning else [])


def test_reasoning_unknown_type():
    with pytest.raises(ValueError, match="unsupported model type"):
        ReasoningParser.named("nope")


def test_chat_output_message_equals_its_stream():
    from sgjax.server.chat_output import ChatOutput

    for out in (
        ChatOutput(tools=get_parser("hermes")),
        ChatOutput(reasoning=ReasoningParser.named("qwen3")),
        ChatOutput(tools=get_parser("hermes"), reasoning=ReasoningParser.named("qwen3")),
    ):
        for text in (
            "  plain answer \n",
            "<think>hm</think>\n\n" + HERMES_TWO,
            HERMES_TWO,
            "<think>only",
            "<think>hm</think>" + HERMES_TWO + "\nIt is 18 C.",
        ):
            msg, called = out.message(text)
            stream, got, calls = out.stream(), {"content": "", "reasoning_content": ""}, {}
            for i in range(1, len(text) + 1):
                pieces = stream.feed(text[:i], final=i == len(text))
                for piece in pieces:
                    for key in ("content", "reasoning_content"):
                        got[key] += piece.get(key, "")
                    for d in piece.get("tool_calls", ()):
                        calls.setdefault(d["index"], ["", ""])
                        calls[d["index"]][0] += d["function"].get("name", "")
                        calls[d["index"]][1] += d["function"]["arguments"]
            assert got["content"] == (msg.get("content") or "")
            assert got["reasoning_content"] == (msg.get("reasoning_content") or "")
            assert [tuple(v) for _, v in sorted(calls.items())] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])
            ]
            assert stream.called == called
