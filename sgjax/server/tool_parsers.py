"""Tool-call formats: model text -> calls (whole, or a stream's growing text), calls -> the format's text.

One class per format the model families use (SGLang's `--tool-call-parser` names):

- `hermes` (alias `qwen25`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call,
  text allowed around them (Qwen2.5, Hermes, SmolLM2).
- `llama3`: the output is JSON calls `{"name": ..., "parameters": {...}}` separated by `; `, optionally after
  `<|python_tag|>` (Llama 3.1-3.3 JSON tool calling); an output that does not start with `{` is text.
- `mistral`: text, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
- `pythonic`: the output is a Python list of calls, `[get_weather(city="Paris"), ...]` (Llama 3.2 / 4).

`scan(text, final)` is the one parser: it returns the text outside calls and the calls found so far. On a stream's
partial text (`final=False`) it holds back whatever may still become part of a call (an unfinished `<tool_call`,
an open block whose name is not complete), so that what it returns only ever grows as text is appended: the stream
sends the difference between two scans, and the deltas concatenate to what `scan(text, final=True)` returns for
the whole output. A call's arguments are the model's own JSON text (as OpenAI returns them), cut from the output
by a JSON scanner, so a partial call's arguments are a prefix of the finished call's. Malformed text never raises:
what does not parse as a call is text.

Each JSON format also spells a call for the constraint grammar (server/tools.py): `head(name)` + arguments +
`tail`, calls joined by `sep` between `prefix` and `suffix`; `render` writes calls the same way (earlier assistant
turns in the history), so what the grammar forces, what the parser reads and what the history shows agree.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from sgjax.fsm.python_literal import literal

# A call object's start, as every JSON format writes it: the name first, then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (the model's own spelling); a stream's unfinished call: a prefix of it
    done: bool = True


@dataclass(frozen=True)
class Scan:
    content: str
    calls: tuple[ToolCall, ...]


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that may yet become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _value_end(text: str, i: int) -> tuple[int, int | None]:
    """(start, end) of the JSON value at text[i:] (leading whitespace skipped); end None: not complete yet."""
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    start, depth, in_str, esc = i, 0, False, False
    while i < n:
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return start, i + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:  # the value closed, or a scalar ended at its container's bracket
                return start, i + 1 if depth == 0 else i
        elif depth == 0 and c in ", \t\r\n;":
            return start, i
        i += 1
    return start, None


def _unescape(name: str) -> str:
    try:
        return json.loads(f'"{name}"')
    except json.JSONDecodeError:
        return name


def _object_call(text: str, pos: int, closed: bool) -> tuple[ToolCall | None, int | None]:
    """The call object at text[pos:] and the index after it (None: not finished). (None, None): not (yet) a call.
    `closed`: no more text will come for this object."""
    m = _HEAD.match(text, pos)
    if m is None:
        return None, None
    start, end = _value_end(text, m.end())
    if end is None:
        return ToolCall(_unescape(m.group(1)), text[start:].rstrip() if closed else text[start:], closed), None
    args, i = text[start:end], end
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i < len(text) and text[i] == "}":
        return ToolCall(_unescape(m.group(1)), args), i + 1
    return ToolCall(_unescape(m.group(1)), args, closed or i < len(text)), None


def _json_call(body: str) -> ToolCall | None:
    """A whole call object in another key order ({"arguments": ..., "name": ...}), normalised."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _args_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class JsonFormat:
    """A format whose calls are JSON objects; subclasses set the wrapper text."""

    name = ""
    prefix, sep, suffix = "", "", ""
    key = "arguments"
    trigger: str | None = None  # the text that opens calls after some text; None: calls only open the answer

    def head(self, name: str) -> str:
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "' + self.key + '": '

    tail = "}"

    def render(self, calls) -> str:
        """(name, arguments JSON text) pairs as the model writes them."""
        return self.prefix + self.sep.join(self.head(n) + _args_text(a) + self.tail for n, a in calls) + self.suffix

    def opener(self) -> str:
        """The text every output with calls starts with (auto's grammar tells text from a call by it)."""
        return self.prefix + self.head("")[:1]

    def example(self) -> str:
        """A call's shape for the prompt's instructions."""
        return self.render([("<function-name>", "<args-json-object>")])


class Hermes(JsonFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    trigger = OPEN
    sep = "\n"
    tail = "}\n" + CLOSE

    def head(self, name: str) -> str:
        return self.OPEN + "\n" + super().head(name)

    def scan(self, text: str, final: bool = True) -> Scan:
        content, calls, pos = [], [], 0
        while True:
            k = text.find(self.OPEN, pos)
            if k < 0:
                rest = text[pos:]
                content.append(rest if final else rest[: len(rest) - _held_prefix(rest, self.OPEN)])
                break
            content.append(text[pos:k])
            body = k + len(self.OPEN)
            e = text.find(self.CLOSE, body)
            closed = e >= 0 or final
            block = text[body : e if e >= 0 else len(text)]
            call, _ = _object_call(block, 0, closed)
            if call is None and closed:
                call = _json_call(block)
            if call is None:
                if not closed:
                    break  # may still become a call: held back
                content.append(text[k : e + len(self.CLOSE) if e >= 0 else len(text)])
            else:
                calls.append(call)
            if e < 0:
                break
            pos = e + len(self.CLOSE)
        return Scan("".join(content), tuple(calls))


def _call_sequence(text: str, pos: int, final: bool, seps: str, close: str | None) -> tuple[list, int, bool]:
    """Call objects from text[pos:], separated by `seps` characters, up to `close` (or the end). (calls, where
    parsing stopped, whether the rest may still be calls: False once it is certainly not)."""
    calls = []
    while True:
        while pos < len(text) and text[pos] in seps + " \t\r\n":
            pos += 1
        if pos == len(text):
            return calls, pos, not final
        if close is not None and text[pos] == close:
            return calls, pos + 1, False
        call, end = _object_call(text, pos, final)
        if call is None:
            return calls, pos, not final and _could_start_call(text[pos:])
        calls.append(call)
        if end is None:
            return calls, len(text), not final
        pos = end


def _could_start_call(rest: str) -> bool:
    """Whether an object whose head does not match yet may still grow into one: it opened, and no arguments key
    has been written (one written before the name is another key order, which these formats do not use)."""
    return rest.startswith("{") and not re.search(r'"(?:arguments|parameters)"\s*:', rest)


class Llama3(JsonFormat):
    name = "llama3"
    TAG = "<|python_tag|>"
    sep = "; "
    key = "parameters"

    def scan(self, text: str, final: bool = True) -> Scan:
        stripped = text.lstrip()
        body = stripped[len(self.TAG) :] if stripped.startswith(self.TAG) else stripped
        if not final and (self.TAG.startswith(stripped) and stripped):
            return Scan("", ())
        if not body.lstrip().startswith("{"):
            if not final and not body.strip():
                return Scan("", ())
            return Scan(text if body is stripped else body, ())
        calls, pos, maybe = _call_sequence(body, 0, final, ";", None)
        if not calls:
            return Scan("" if maybe else text, ())
        return Scan("" if maybe else body[pos:], tuple(calls))


class Mistral(JsonFormat):
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    trigger = MARK
    prefix, sep, suffix = MARK + " [", ", ", "]"

    def opener(self) -> str:
        return self.MARK

    def scan(self, text: str, final: bool = True) -> Scan:
        k = text.find(self.MARK)
        if k < 0:
            return Scan(text if final else text[: len(text) - _held_prefix(text, self.MARK)], ())
        rest, pos = text[k + len(self.MARK) :], 0
        while pos < len(rest) and rest[pos] in " \t\r\n":
            pos += 1
        bracket = pos < len(rest) and rest[pos] == "["
        calls, end, maybe = _call_sequence(rest, pos + 1 if bracket else pos, final, ",", "]" if bracket else None)
        if not calls and not maybe:
            return Scan(text, ())
        if maybe:
            return Scan(text[:k], tuple(calls))
        after = self.scan(rest[end:], final)  # text after the calls, in which another [TOOL_CALLS] may open more
        return Scan(text[:k] + after.content, tuple(calls) + after.calls)


class Pythonic:
    """`[f(a=1), g(b="x")]`: keyword arguments of Python literals, turned into JSON arguments. The grammar spells a
    call as `head(name)` + keyword arguments (fsm/python_literal.py) + `tail`, as the JSON formats do."""

    name = "pythonic"
    prefix, sep, suffix, tail = "[", ", ", "]", ")"
    trigger = None  # the calls are the whole answer

    def head(self, name: str) -> str:
        return name + "("

    def opener(self) -> str:
        return self.prefix

    def example(self) -> str:
        return "[<function-name>(<argument>=<python-literal>, ...), ...]"

    def render(self, calls) -> str:
        def call(name, args):
            values = json.loads(args) if isinstance(args, str) else args
            return f"{name}(" + ", ".join(f"{k}={literal(v)}" for k, v in (values or {}).items()) + ")"

        return "[" + ", ".join(call(n, a) for n, a in calls) + "]"

    def scan(self, text: str, final: bool = True) -> Scan:
        body = text.strip()
        if not body.startswith("["):
            return Scan("" if not final and not body else text, ())
        calls = self._parse(body) if body.endswith("]") else None
        if calls is not None:
            return Scan("", calls)
        if not final and re.match(r"\[\s*([A-Za-z_][\w.]*\s*(\(.*)?)?$", body, re.S):
            return Scan("", ())  # an unfinished list of calls
        return Scan(text, ())

    @staticmethod
    def _parse(body: str) -> tuple[ToolCall, ...] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            try:
                name = ast.unparse(node.func)
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        return tuple(calls)


PARSERS = {"hermes": Hermes, "qwen25": Hermes, "llama3": Llama3, "mistral": Mistral, "pythonic": Pythonic}


def get_parser(name: str):
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser {name!r}: unknown; known: {', '.join(sorted(PARSERS))}") from None


def default_parser_name(chat_template: str | None) -> str:
    """The format a chat template's own tool section writes; hermes when it has none (SmolLM2's ChatML: SmolLM2
    was tuned on `<tool_call>` blocks, as Qwen2.5 is)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "hermes"


@dataclass(frozen=True)
class CallDelta:
    index: int
    name: str | None  # set on a call's first delta only
    arguments: str


def final_content(content: str) -> str:
    """The text around calls as answered: whitespace next to the calls is layout, not an answer."""
    return content.strip()


class Stream:
    """A stream's parser: `feed(delta)` with each new piece of output, `feed("", final=True)` at its end; each
    returns the new content text and the calls' new pieces. Their concatenation is `scan(whole, final=True)`."""

    def __init__(self, fmt):
        self.fmt, self.text = fmt, ""
        self._content = ""
        self._calls: list[str] = []  # arguments sent, per call

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += delta
        scan = self.fmt.scan(self.text, final)
        # Trailing whitespace may be the layout before a call: sent once text follows it, or dropped at the end.
        content = final_content(scan.content) if final else scan.content.lstrip().rstrip()
        new = content[len(self._content) :] if content.startswith(self._content) else ""
        self._content = content if content.startswith(self._content) else self._content
        out = []
        for i, call in enumerate(scan.calls):
            if i == len(self._calls):
                self._calls.append(call.arguments)
                out.append(CallDelta(i, call.name, call.arguments))
            elif len(call.arguments) > len(self._calls[i]) and call.arguments.startswith(self._calls[i]):
                out.append(CallDelta(i, None, call.arguments[len(self._calls[i]) :]))
                self._calls[i] = call.arguments
        return new, out
