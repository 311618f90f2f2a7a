"""OpenAI tool calling over a chat template: the request's tools -> the prompt and the constraint grammar; the
model's text -> OpenAI's `tool_calls`.

`tool_choice` (docs/server.md, "Tools and reasoning"):

- `none`: the tools are left out of the prompt and the output is text (OpenAI's meaning: the model will not call).
- `auto` (the default with tools): the model answers in text or calls. Formats whose calls may follow text
  (hermes's `<tool_call>`, mistral's `[TOOL_CALLS]`): free text that never writes the trigger, calls held to the
  functions' grammar from the trigger on, free text again after them (fsm/structural_tag.py, SGLang's structural
  tags; more calls only with parallel_tool_calls). llama3's and pythonic's
  calls only open an answer: one that opens with `{` / `[` must be calls; any other first character starts free text.
- `required`: one or more calls, nothing else; `parallel_tool_calls: false` makes it exactly one.
- a named function: exactly one call of that function.

The grammar is one regex (our cFSM's input): the format's wrapper text, literal, around each function's name and
its parameters' JSON-schema regex (fsm/json_schema.py; for `pythonic`, keyword arguments of Python literals,
fsm/python_literal.py). Its fixed text (the wrapper, the name, the first keys) is
what jump-forward appends without decoding.

Templates that know tools (they read `tools`, e.g. Qwen2.5's) get the tools and the history's `tool_calls` and
`tool` messages as such; others (SmolLM2's ChatML, the built-in Llama-3 template) get the tools described in a
system message, earlier calls written in the parser's format in the assistant's text, and tool results as user
turns wrapped in `<tool_response>` tags (Qwen2.5's convention).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from sgjax.fsm.errors import GrammarError
from sgjax.fsm.json_schema import schema_to_regex
from sgjax.fsm.python_literal import call_name_regex, keyword_arguments_regex
from sgjax.fsm.structural_tag import without
from sgjax.server.protocol import ApiError
from sgjax.server.tool_parsers import Pythonic, ToolCall

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function names (plus the dots BFCL's names use)
_NO_PARAMS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its answer."""

    functions: tuple[Function, ...]  # offered in the prompt (none with tool_choice "none")
    choice: str  # none | auto | required | named
    parallel: bool
    regex: str | None  # the constraint; None: unconstrained

    @property
    def parse(self) -> bool:
        return self.choice != "none" and bool(self.functions)


NO_TOOLS = ToolPlan((), "none", True, None)


def plan(req, fmt, constrain: bool = True, reasoning=None) -> ToolPlan:
    """`constrain` False (--disable-tool-call-constraint, the ablation): the same prompt, no grammar. `reasoning`:
    the answer's ReasoningParser, whose `<think>` block the grammar lets the model write before the calls."""
    functions = _functions(req.tools or [])
    choice, named = _choice(req.tool_choice, functions)
    parallel = req.parallel_tool_calls is not False
    if choice == "none" or not functions:
        return ToolPlan((), "none", parallel, None)
    if not constrain:
        return ToolPlan(functions, choice, parallel, None)
    targets = [(i, f) for i, f in enumerate(functions) if named is None or f.name == named]
    one = "(?:" + "|".join(_call_regex(fmt, f, i) for i, f in targets) + ")"
    many = one if (named is not None or not parallel) else f"{one}(?:{_lit(fmt.sep)}{one})*"
    calls = _lit(fmt.prefix) + many + _lit(fmt.suffix)
    if choice == "auto" and fmt.trigger is not None:
        # SGLang's structural tags: free text that never writes the trigger; where the trigger is written, calls held
        # to the functions' grammar; then free text again, in which the trigger may open more calls (one group
        # only with parallel_tool_calls false, after which the text can no longer write the trigger).
        text = without(fmt.trigger)
        calls = f"{text}(?:{calls}{text})" + ("*" if parallel else "?")
    elif choice == "auto":  # the format's calls only open an answer (llama3, pythonic): its first character decides
        opener = fmt.opener()[0]
        calls = f"(?:{calls}|(?:[^{_class_char(opener)}][\\s\\S]*)?)"
    if reasoning is not None and not (choice == "auto" and fmt.trigger is not None and not reasoning.forced):
        # (auto's free text already admits an optional type's <think> block, only not the trigger in it; the
        # prefix there would make every "<think>" ambiguous between the two, a DFA that takes tens of seconds to build)
        calls = reasoning.grammar_prefix() + calls
    return ToolPlan(functions, choice, parallel, calls)


def _functions(tools) -> tuple[Function, ...]:
    out, seen = [], set()
    for i, tool in enumerate(tools):
        f = tool.function
        if not _NAME.match(f.name):
            raise ApiError(
                f"tools.{i}.function.name: must be 1-64 letters, digits, '_', '-' or '.', got {f.name!r}",
                param=f"tools.{i}.function.name",
            )
        if f.name in seen:
            raise ApiError(f"tools.{i}.function.name: {f.name!r} is defined twice", param=f"tools.{i}.function.name")
        seen.add(f.name)
        out.append(Function(f.name, f.description, f.parameters if f.parameters is not None else _NO_PARAMS))
    return tuple(out)


def _choice(value, functions) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if functions else "none"), None
    if isinstance(value, str):
        if value != "none" and not functions:
            raise ApiError(f"tool_choice: {value!r} needs tools", param="tool_choice")
        return value, None
    name = value.function.name
    if name not in {f.name for f in functions}:
        raise ApiError(
            f"tool_choice.function.name: {name!r} is not one of the tools", param="tool_choice.function.name"
        )
    return "named", name


def _call_regex(fmt, f: Function, i: int) -> str:
    pythonic = isinstance(fmt, Pythonic)
    if pythonic:
        try:
            call_name_regex(f.name)
        except GrammarError as e:
            raise ApiError(f"tools.{i}.function.name: {e}", param=f"tools.{i}.function.name") from None
    try:
        args = keyword_arguments_regex(f.parameters) if pythonic else schema_to_regex(f.parameters)
    except GrammarError as e:
        raise ApiError(f"tools.{i}.function.parameters: {e}", param=f"tools.{i}.function.parameters") from None
    except (RecursionError, TypeError, ValueError) as e:
        raise ApiError(
            f"tools.{i}.function.parameters: invalid schema ({e})", param=f"tools.{i}.function.parameters"
        ) from None
    return _lit(fmt.head(f.name)) + f"(?:{args})" + _lit(fmt.tail)


def _lit(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


# -- the prompt -------------------------------------------------------------------------------------------------
def template_input(messages: list[dict], tool_plan: ToolPlan, fmt, template: str | None) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for the chat template. `messages` carry the requests' `tool_calls`
    ((name, arguments JSON text) pairs) and `tool_call_id` as dict keys."""
    specs = [
        {
            "type": "function",
            "function": {
                "name": f.name,
                **({"description": f.description} if f.description else {}),
                "parameters": f.parameters,
            },
        }
        for f in tool_plan.functions
    ]
    if template is not None and "tools" in template:
        return [_native(m) for m in messages], ({"tools": specs} if specs else {})
    out = [_plain(m, fmt) for m in messages]
    if specs:
        text = _instructions(specs, fmt)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def _native(m: dict) -> dict:
    """A message as templates with tools read it (Qwen2.5's, Llama-3.1's): arguments as objects."""
    if not m.get("tool_calls"):
        return m
    calls = [{"type": "function", "function": {"name": n, "arguments": _loads(a)}} for n, a in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def _plain(m: dict, fmt) -> dict:
    if m.get("tool_calls"):
        text = fmt.render(m["tool_calls"])
        content = m["content"] + "\n" + text if m["content"] else text
        return {"role": "assistant", "content": content}
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return {k: v for k, v in m.items() if k != "tool_call_id"}


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def _instructions(specs: list[dict], fmt) -> str:
    example = fmt.example()
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    # The fixed text first: requests with different tools share its KV pages in the radix cache.
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query. To call functions, reply "
        f"with the calls only, in this form:\n{example}\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{listing}\n</tools>"
    )


# -- the answer -------------------------------------------------------------------------------------------------
def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
    ]
