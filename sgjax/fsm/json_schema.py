"""JSON Schema -> regex in our dialect (the regular subset of JSON Schema).

Objects emit their properties in schema order with fixed separators by default: fixed text makes
long singular chains, which is what jump-forward skips (46-54 % of tokens with fixed `", "`/`": "`
against 13-14 % with flexible whitespace, anchors/constrained-decoding.md). Recursive schemas and
keywords we cannot express raise `GrammarError` naming the schema path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sgjax.fsm.errors import GrammarError

# JSON string content: any char except `"`, `\` and controls, or an escape. \u escapes exclude
# surrogates: a lone one is not valid JSON and a pair would count as two characters for min/maxLength.
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
FORMATS = {
    "date": r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])",
    "time": r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
FORMATS["date-time"] = FORMATS["date"] + "T" + FORMATS["time"]
# Nesting levels of a free-form value (`{}`, an object without properties, an array without items, a
# json_object response). Any JSON is not regular, so containers nest at most this deep. One more level would not
# compile: each level holds four copies of the one below, and at 5 the DFA construction passes 50000 states.
FREE_DEPTH = 4
# Keywords that only describe or annotate; they never constrain what we emit.
_IGNORED = {
    "title",
    "description",
    "examples",
    "default",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "additionalProperties",
    "$defs",
    "definitions",
    "type",
    "format",
    "nullable",
    "strict",
}
_ANNOTATIONS = {"title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly"}
_HANDLED = {
    "properties",
    "required",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
}


@dataclass(frozen=True)
class JsonOptions:
    """item_sep / key_sep: the fixed separators; whitespace: a regex allowed around structure
    instead (flexible mode, e.g. r"[ \\n]?"), None for fixed separators."""

    item_sep: str = ", "
    key_sep: str = ": "
    whitespace: str | None = None


def schema_to_regex(schema, options: JsonOptions | None = None) -> str:
    if isinstance(schema, str):
        schema = json.loads(schema)
    return _Converter(schema, options or JsonOptions()).convert(schema, "#", ())


def _lit(text: str) -> str:
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


class _Converter:
    # The literal syntax of scalars: JSON's; fsm/python_literal.py swaps in Python's and keeps the structure.
    BOOLEAN = "(?:true|false)"
    NULL = "null"

    def __init__(self, root, options: JsonOptions):
        self.root = root
        self.opt = options
        ws = options.whitespace
        self.item_sep = _lit(options.item_sep) if ws is None else f"{ws},{ws}"
        self.key_sep = _lit(options.key_sep) if ws is None else f"{ws}:{ws}"
        self.open_ws = "" if ws is None else ws

    def convert(self, schema, path: str, refs: tuple) -> str:
        if schema is True or schema == {}:
            return self.free_value(FREE_DEPTH)
        if not isinstance(schema, dict):
            raise GrammarError(f"{path}: a schema must be an object, got {schema!r}")
        unknown = set(schema) - _IGNORED - _HANDLED
        if unknown:
            raise GrammarError(f"{path}: unsupported keyword(s) {sorted(unknown)}")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path, refs)
        if "const" in schema:
            return _lit(self.dump(schema["const"]))
        if "enum" in schema:
            return "(?:" + "|".join(_lit(self.dump(v)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                # oneOf is emitted as anyOf: exclusivity is not regular in general (documented).
                return (
                    "(?:"
                    + "|".join(self.convert(s, f"{path}/{key}/{i}", refs) for i, s in enumerate(schema[key]))
                    + ")"
                )
        if "allOf" in schema:
            if len(schema["allOf"]) != 1:
                raise GrammarError(f"{path}/allOf: only a single sub-schema is supported")
            return self.convert(schema["allOf"][0], f"{path}/allOf/0", refs)
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(?:" + "|".join(self.typed(t, schema, path, refs) for t in kind) + ")"
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
            if kind is None:
                if set(schema) <= _ANNOTATIONS:  # only describes the value (BFCL's "any" parameters): any JSON
                    return self.free_value(FREE_DEPTH)
                raise GrammarError(f"{path}: schema has no type")
        return self.typed(kind, schema, path, refs)

    def dump(self, value) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(self.opt.item_sep, self.opt.key_sep))

    def ref(self, ref: str, path: str, refs: tuple) -> str:
        if not ref.startswith("#"):
            raise GrammarError(f"{path}: only local $ref ('#/...') is supported, got {ref!r}")
        if ref in refs:
            raise GrammarError(f"{path}: recursive $ref {ref!r} cannot be expressed as a regular grammar")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise GrammarError(f"{path}: $ref {ref!r} does not resolve")
            node = node[part]
        return self.convert(node, ref, refs + (ref,))

    def typed(self, kind: str, schema: dict, path: str, refs: tuple) -> str:
        if kind == "string":
            return self.string(schema, path)
        if kind == "integer":
            return self.integer(schema, path)
        if kind == "number":
            return self.number(schema, path)
        if kind == "boolean":
            return self.BOOLEAN
        if kind == "null":
            return self.NULL
        if kind == "array":
            return self.array(schema, path, refs)
        if kind == "object":
            return self.object(schema, path, refs)
        raise GrammarError(f"{path}: unknown type {kind!r}")

    def string(self, schema: dict, path: str) -> str:
        if "pattern" in schema:
            pattern = schema["pattern"]
            # JSON Schema patterns search; treat ^...$ (the common case) as the full string content.
            if pattern.startswith("^"):
                pattern = pattern[1:]
            if pattern.endswith("$") and not pattern.endswith("\\$"):
                pattern = pattern[:-1]
            return f'"(?:{pattern})"'
        fmt = schema.get("format")
        if fmt in FORMATS:
            return f'"{FORMATS[fmt]}"'
        lo = int(schema.get("minLength", 0))
        hi = schema.get("maxLength")
        if hi is not None and int(hi) < lo:
            raise GrammarError(f"{path}: maxLength < minLength")
        reps = "*" if lo == 0 and hi is None else f"{{{lo},{'' if hi is None else int(hi)}}}"
        return self.quoted(reps)

    def quoted(self, reps: str) -> str:
        """A string literal whose content is `reps` (a repetition suffix) characters."""
        return f'"{STRING_CHAR}{reps}"'

    def integer(self, schema: dict, path: str) -> str:
        lo, hi = _bounds(schema, path, integer=True)
        if lo is None and hi is None:
            return INTEGER
        return int_range_regex(lo, hi)

    def number(self, schema: dict, path: str) -> str:
        lo, hi = _bounds(schema, path, integer=False)
        if hi is not None or (lo is not None and lo != 0):
            raise GrammarError(f"{path}: number bounds other than minimum 0 are not supported (use integer)")
        if lo == 0:
            return NUMBER[2:]  # drop the optional minus sign
        return NUMBER

    def free_value(self, depth: int) -> str:
        """Any JSON value whose containers nest at most `depth` deep."""
        scalar = f"(?:{self.quoted('*')}|{NUMBER}|{self.BOOLEAN}|{self.NULL})"
        if depth == 0:
            return scalar
        inner = self.free_value(depth - 1)
        return f"(?:{scalar}|{self.free_array(inner)}|{self.free_object(inner)})"

    def free_array(self, item: str) -> str:
        ws = self.open_ws
        return rf"\[{ws}(?:{item}(?:{self.item_sep}{item})*)?{ws}\]"

    def free_object(self, value: str) -> str:
        """An object with any keys, each value matching `value`."""
        ws, pair = self.open_ws, f"{self.quoted('*')}{self.key_sep}{value}"
        return rf"\{{{ws}(?:{pair}(?:{self.item_sep}{pair})*)?{ws}\}}"

    def array(self, schema: dict, path: str, refs: tuple) -> str:
        items = schema.get("items")
        if items is None:  # any items
            item = self.free_value(FREE_DEPTH - 1)
        else:
            item = self.convert(items, f"{path}/items", refs)
        lo = int(schema.get("minItems", 0))
        hi = schema.get("maxItems")
        hi = None if hi is None else int(hi)
        if hi is not None and hi < lo:
            raise GrammarError(f"{path}: maxItems < minItems")
        ws = self.open_ws
        if hi == 0:
            return rf"\[{ws}\]"
        rest_hi = "" if hi is None else hi - 1
        body = f"(?:{item})(?:{self.item_sep}(?:{item})){{{max(lo - 1, 0)},{rest_hi}}}"
        if lo == 0:
            body = f"(?:{body})?"
        return rf"\[{ws}{body}{ws}\]"

    def object(self, schema: dict, path: str, refs: tuple) -> str:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        missing = required - set(props)
        if missing:
            raise GrammarError(f"{path}: required properties {sorted(missing)} have no schema in 'properties'")
        ws = self.open_ws
        parts = [
            (
                f"{_lit(self.dump(name))}{self.key_sep}(?:{self.convert(sub, f'{path}/properties/{name}', refs)})",
                name in required,
            )
            for name, sub in props.items()
        ]
        if not parts:
            # No properties: any keys, unless additionalProperties says none (False) or gives their schema.
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return rf"\{{{ws}\}}"
            if extra is True or extra == {}:
                return self.free_object(self.free_value(FREE_DEPTH - 1))
            return self.free_object(f"(?:{self.convert(extra, f'{path}/additionalProperties', refs)})")
        return rf"\{{{ws}{self.members(parts)}{ws}\}}"

    def members(self, parts: list[tuple[str, bool]]) -> str:
        """(member regex, required) pairs -> any subset of them in order that holds the required ones."""
        # Choose the first emitted member i (all before it optional), then each later one is `sep member`.
        alternatives = []
        for i, (first, _) in enumerate(parts):
            tail = "".join(f"{self.item_sep}{p}" if req else f"(?:{self.item_sep}{p})?" for p, req in parts[i + 1 :])
            alternatives.append(first + tail)
            if parts[i][1]:
                break
        body = "(?:" + "|".join(alternatives) + ")"
        return body if any(req for _, req in parts) else body + "?"


def _bounds(schema: dict, path: str, integer: bool):
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if "exclusiveMinimum" in schema:
        if not integer:
            raise GrammarError(f"{path}: exclusiveMinimum on numbers is not supported")
        lo = schema["exclusiveMinimum"] + 1
    if "exclusiveMaximum" in schema:
        if not integer:
            raise GrammarError(f"{path}: exclusiveMaximum on numbers is not supported")
        hi = schema["exclusiveMaximum"] - 1
    if integer:
        import math

        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
        if lo is not None and hi is not None and hi < lo:
            raise GrammarError(f"{path}: maximum < minimum")
    return lo, hi


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """Regex for the decimal integers in [lo, hi] (either bound may be None = unbounded)."""
    alts = []
    if lo is None or lo < 0:  # negative part: -(range of magnitudes)
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        neg_hi = None if lo is None else -lo
        if neg_hi is None or neg_hi >= neg_lo:
            alts.append("-" + _nonneg_range(neg_lo, neg_hi))
    if hi is None or hi >= 0:
        alts.append(_nonneg_range(max(lo or 0, 0) if lo is not None else 0, hi))
    return "(?:" + "|".join(alts) + ")"


def _nonneg_range(lo: int, hi: int | None) -> str:
    if hi is None:
        digits = len(str(lo))  # below 10**digits: explicit ranges; above: any longer number
        return "(?:" + "|".join(_same_width_ranges(lo, 10**digits - 1) + [f"[1-9][0-9]{{{digits},}}"]) + ")"
    return "(?:" + "|".join(_same_width_ranges(lo, hi)) + ")"


def _same_width_ranges(lo: int, hi: int) -> list[str]:
    out = []
    while lo <= hi:
        width = len(str(lo))
        top = min(hi, 10**width - 1)
        out += _digit_ranges(str(lo), str(top))
        lo = top + 1
    return out


def _digit_ranges(a: str, b: str) -> list[str]:
    """Regexes for equal-width decimal strings in [a, b]."""
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + r for r in _digit_ranges(a[1:], b[1:])]
    n = len(a) - 1
    out = []
    if a[1:] == "0" * n:
        first = a[0]
    else:
        out += [a[0] + r for r in _digit_ranges(a[1:], "9" * n)]
        first = str(int(a[0]) + 1)
    last = b[0] if b[1:] == "9" * n else str(int(b[0]) - 1)
    if int(first) <= int(last):
        out.append(f"[{first}-{last}][0-9]{{{n}}}")
    if b[1:] != "9" * n:
        out += [b[0] + r for r in _digit_ranges("0" * n, b[1:])]
    return out
