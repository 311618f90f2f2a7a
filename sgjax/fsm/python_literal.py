"""JSON Schema -> regex of Python literals: the keyword arguments of a `pythonic` tool call (`f(city="Paris")`).

The structure is the JSON converter's (fsm/json_schema.py: the same keywords, bounds and property order); only the
scalars' spelling changes: strings are double-quoted Python string literals, booleans `True` / `False`, null
`None`, arrays lists, objects dicts with string keys. Each such text is one `ast.literal_eval` value whose JSON form
validates against the schema; the escapes are the ones Python and JSON read alike (no `\\/`, `\\x`, `\\N`: their
lengths or meanings differ). One quote, as `literal` writes the history's calls: the grammar, the prompt and the
parser agree, the opening quote is fixed text for jump-forward, and a second quote style would double the free-form
values' automaton past the DFA limit (FREE_DEPTH's four levels).
"""

from __future__ import annotations

import json
import keyword

from sgjax.fsm.errors import GrammarError
from sgjax.fsm.json_schema import JsonOptions, _Converter, _lit

_U = r"\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})"  # no surrogates, as in JSON strings
_CHAR = rf'(?:[^"\\\x00-\x1f]|\\["\\bfnrt]|{_U})'
_TOP_KEYS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "title",
    "description",
    "$defs",
    "definitions",
    "$schema",
    "$id",
    "$comment",
    "strict",
    "examples",
    "default",
}


class _PythonConverter(_Converter):
    BOOLEAN = "(?:True|False)"
    NULL = "None"

    def quoted(self, reps: str) -> str:
        return f'"{_CHAR}{reps}"'

    def dump(self, value) -> str:
        try:
            return literal(value)
        except TypeError as e:
            raise GrammarError(str(e)) from None

    def keyword_arguments(self, schema) -> str:
        if schema is True or schema == {}:
            return ""
        if not isinstance(schema, dict) or schema.get("type", "object") != "object" or set(schema) - _TOP_KEYS:
            raise GrammarError(
                "#: a pythonic call's parameters must be an object schema of named properties "
                "(type, properties, required), its keyword arguments"
            )
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if required - set(props):
            raise GrammarError(f"#: required properties {sorted(required - set(props))} have no schema in 'properties'")
        parts = []
        for name, sub in props.items():
            if not name.isidentifier() or keyword.iskeyword(name):
                raise GrammarError(f"#/properties/{name}: not a Python identifier, so not a keyword argument")
            parts.append((f"{name}=(?:{self.convert(sub, f'#/properties/{name}', ())})", name in required))
        # Without properties the call takes none: `f()` is valid whatever additionalProperties allows.
        return self.members(parts) if parts else ""


def literal(value) -> str:
    """A JSON value as the Python literal the grammar spells (`repr` would pick single quotes)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, (int, float, str)):
        return json.dumps(value, ensure_ascii=False)  # JSON's numbers and double-quoted strings are Python's
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(str(k))}: {literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"{value!r} has no literal")


def keyword_arguments_regex(schema) -> str:
    """`a=1, b="x"` (the text between a call's parentheses) for a function's `parameters` schema."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    return _PythonConverter(schema, JsonOptions()).keyword_arguments(schema)


def call_name_regex(name: str) -> str:
    """A function name as Python calls it (dotted identifiers, as BFCL's `math.factorial`)."""
    if not all(part.isidentifier() and not keyword.iskeyword(part) for part in name.split(".")):
        raise GrammarError(f"{name!r} is not a Python name, so a pythonic call cannot name it")
    return _lit(name)
