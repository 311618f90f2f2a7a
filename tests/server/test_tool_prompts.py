"""Tools in the prompt (through the model's own chat template) and the constraint grammar of each tool_choice,
without a server: SmolLM2's ChatML template, a template that reads `tools` as Qwen2.5's does, the built-in
Llama-3 template with the llama3 format."""

import json
import re

import pytest

from sgjax.fsm import from_tokenizer
from sgjax.fsm.grammar import compile_grammar
from sgjax.model.chat_templates import LLAMA3
from sgjax.server import tools
from sgjax.server.protocol import ApiError, ChatCompletionRequest
from sgjax.server.tool_parsers import get_parser
from sgjax.server.tools import template_input
from sgjax.model.tokenizer import _compile_template

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: the arguments are {}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [("get_weather", '{"city": "Paris"}')]},
           {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]
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
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
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


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
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
    ] + ([("auto", ["Let me check.\n" + one, "x < y, [TOOL] <tool"], ["Sure. " + bad, "Sure. " + one + " Done."])]
         if parser.trigger else []):
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


def test_pythonic_cannot_be_forced_and_auto_is_free():
    with pytest.raises(ApiError) as e:
        tools.plan(_req(tools=[WEATHER], tool_choice="required"), get_parser("pythonic"))
    assert e.value.param == "tool_choice"
    assert tools.plan(_req(tools=[WEATHER]), get_parser("pythonic")).regex is None
    assert tools.plan(_req(tools=[WEATHER], tool_choice="required"), get_parser("hermes"), constrain=False).regex is None
