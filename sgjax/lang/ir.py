"""The expressions a program appends to its prompt state with `s += ...`.

They are plain data: the interpreter executes them against a backend, the tracer records them as graph nodes.
`a + b` between expressions (or an expression and a str) builds a flat `ExprList`, so
`assistant("Judgment:" + gen("judgment"))` is one list of a constant, a gen and the role markers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# What a gen may override; the rest of a request's sampling parameters come from `run(...)` and the backend.
GEN_PARAMS = ("max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
              "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "regex",
              "json_schema", "return_logprob", "logprob_start_len", "top_logprobs_num")
# Not sampling parameters: they ask the backend for logprobs in the result's meta info.
LOGPROB_PARAMS = ("return_logprob", "logprob_start_len", "top_logprobs_num")

# gen(dtype=...) as SGLang spells it, in our regex dialect (full match; ASCII classes).
DTYPE_REGEX = {
    int: r"[-+]?[0-9]+",
    float: r"[-+]?[0-9]*\.?[0-9]+",
    str: r'"[\w\d\s]*"',
    bool: "(True|False)",
}


class Expr:
    def __add__(self, other):
        return ExprList.of(self, other)

    def __radd__(self, other):
        return ExprList.of(other, self)


def as_expr(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"a program state takes str or sgjax expressions (gen, select, roles), "
                    f"not {type(value).__name__}: {value!r}")


@dataclass(eq=False)
class Constant(Expr):
    text: str

    def __repr__(self):
        return f"Constant({self.text!r})"


@dataclass(eq=False)
class ExprList(Expr):
    items: tuple

    @classmethod
    def of(cls, *values) -> "ExprList":
        items = []
        for v in values:
            e = as_expr(v)
            items.extend(e.items if isinstance(e, ExprList) else [e])
        return cls(tuple(items))

    def __repr__(self):
        return f"ExprList({list(self.items)})"


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: dict = field(default_factory=dict)  # only the fields the program set (GEN_PARAMS names)

    def __repr__(self):
        return f"gen({self.name!r})"


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: object  # a sgjax.lang.choices method

    def __repr__(self):
        return f"select({self.name!r}, {list(self.choices)})"


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str

    def __repr__(self):
        return f"{self.role}_begin()"


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str

    def __repr__(self):
        return f"{self.role}_end()"


@dataclass(eq=False)
class Image(Expr):
    """Images in the prompt (one for sgl.image, the sampled frames for sgl.video): each is a base64 string of the
    encoded image or an http(s) URL (sgjax.lang.media). The text gets the chat template's image token per image."""

    data: tuple[str, ...]
    kind: str = "image"  # image | video

    def __repr__(self):
        return f"{self.kind}({len(self.data)} image{'s' if len(self.data) != 1 else ''})"


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


def role(name: str, expr=None) -> ExprList:
    """A whole message: the role's begin marker, the content, its end marker."""
    return ExprList.of(RoleBegin(name), *([] if expr is None else [expr]), RoleEnd(name))


def variable_names(expr: Expr) -> list[str]:
    """The variables an expression defines once executed (so readers can wait for them before it runs)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, VarScopeEnd):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for e in expr.items for n in variable_names(e)]
    return []


def make_gen(name, dtype=None, regex=None, json_schema=None, **params) -> Gen:
    """A Gen with only the parameters that were given; dtype becomes a regex, a dict schema a JSON string."""
    if dtype is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen: give at most one of dtype, regex and json_schema")
        key = {"int": int, "float": float, "str": str, "bool": bool}.get(dtype, dtype)
        if key not in DTYPE_REGEX:
            raise ValueError(f"gen: dtype must be one of int, float, str, bool; got {dtype!r}")
        regex = DTYPE_REGEX[key]
    if regex is not None and json_schema is not None:
        raise ValueError("gen: give at most one of regex and json_schema")
    if isinstance(json_schema, (dict, list)):
        json_schema = json.dumps(json_schema)
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    params.update(regex=regex, json_schema=json_schema)
    return Gen(name, {k: v for k, v in params.items() if v is not None})
