"""The expressions a program appends to its prompt state with `s += ...`.

They are plain data: the interpreter executes them against a backend, the tracer records them as graph nodes.
`a + b` between expressions (or an expression and a str) builds a flat `ExprList`, so
`assistant("Judgment:" + gen("judgment"))` is one list of a constant, a gen and the role markers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# What a gen may override; the rest of a request's sampling parameters come from `run(...)` and the backend.
GEN_PARAMS = (
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "regex",
    "json_schema",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)
# Not sampling parameters: they ask the backend for logprobs in the result's meta info.
LOGPROB_PARAMS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

# The regexes SGLang exports from `sglang.lang.ir` (its JSON-regex programs import them), spelled as SGLang spells
# them: sgjax.fsm compiles each as is (full match; \w \d \s are ASCII classes), tested against Python's re.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# gen(dtype=...) as SGLang runs it: the regex, plus stop strings for the numbers. A number's regex admits
# trailing spaces and newlines and the gen stops at the first one (trimmed), so the model can end the number the
# way it wants to; without that a model that would write "24\n" is forced to keep writing digits.
DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, str: REGEX_STR, bool: REGEX_BOOL}
DTYPE_STOP = {int: (" ", "\n"), float: (" ", "\n")}


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
    raise TypeError(
        f"a program state takes str or sgjax expressions (gen, select, roles), not {type(value).__name__}: {value!r}"
    )


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

    @property
    def expr_list(self) -> list:  # SGLang's name for the items
        return list(self.items)

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


REASONING_SUFFIX = "_reasoning_content"


@dataclass(eq=False)
class SeparateReasoning(Expr):
    """After `expr` ran: split each of its named gens' / selects' values into the reasoning (`<think>...</think>`,
    into `{name}_reasoning_content`) and the answer (into `name`, and in place of the value in the text), as the
    model type's reasoning format says (sgjax/lang/reasoning.py). `sgl.separate_reasoning(gen, model_type)`."""

    model_type: str | None
    expr: Expr
    name: str | None = field(default=None, init=False)  # the (last) reasoning variable, as SGLang reports it

    def __post_init__(self):
        for name in self.names():
            self.name = self.process_name_for_reasoning(name)

    def names(self) -> list[str]:
        """The variables whose values are split."""
        items = self.expr.items if isinstance(self.expr, ExprList) else (self.expr,)
        return [e.name for e in items if isinstance(e, (Gen, Select)) and self._named(e)]

    @staticmethod
    def _named(e) -> bool:
        if not e.name:
            raise ValueError(
                f"separate_reasoning: {e!r} needs a name (its reasoning goes to name + {REASONING_SUFFIX!r})"
            )
        return True

    @staticmethod
    def process_name_for_reasoning(name: str) -> str:
        if not name:
            raise ValueError("separate_reasoning: name must be provided")
        return name + REASONING_SUFFIX

    def __repr__(self):
        return f"SeparateReasoning(model_type={self.model_type}, name={self.name})"


def role(name: str, expr=None) -> ExprList:
    """A whole message: the role's begin marker, the content, its end marker."""
    return ExprList.of(RoleBegin(name), *([] if expr is None else [expr]), RoleEnd(name))


def variable_names(expr: Expr) -> list[str]:
    """The variables an expression defines once executed (so readers can wait for them before it runs)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, VarScopeEnd):
        return [expr.name]
    if isinstance(expr, SeparateReasoning):  # redefines each name and defines its reasoning variable
        return [n for name in expr.names() for n in (name, expr.process_name_for_reasoning(name))]
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
    if dtype is not None and key in DTYPE_STOP:
        stop = list(params.get("stop") or ())
        params["stop"] = stop + [s for s in DTYPE_STOP[key] if s not in stop]
    params.update(regex=regex, json_schema=json_schema)
    return Gen(name, {k: v for k, v in params.items() if v is not None})


def reasoning_names(expr: Expr) -> set[str]:
    """The gens' / selects' names a SeparateReasoning in `expr` redefines: their first value is not final."""
    if isinstance(expr, SeparateReasoning):
        return set(expr.names())
    if isinstance(expr, ExprList):
        return {n for e in expr.items for n in reasoning_names(e)}
    return set()


# SGLang's names for the expressions (`from sglang.lang.ir import SglExprList, SglGen, ...` in its programs and
# tests): the same classes under the names upstream code imports.
SglExpr = Expr
SglExprList = ExprList
SglConstantText = Constant
SglGen = Gen
SglSelect = Select
SglRoleBegin = RoleBegin
SglRoleEnd = RoleEnd
SglImage = SglVideo = Image
SglVarScopeBegin = VarScopeBegin
SglVarScopeEnd = VarScopeEnd
SglSeparateReasoning = SeparateReasoning


def split_run_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """run(...)'s keyword arguments: sampling defaults (GEN_PARAMS names) vs the program's own arguments."""
    sampling = {k: v for k, v in kwargs.items() if k in GEN_PARAMS and v is not None}
    program = {k: v for k, v in kwargs.items() if k not in GEN_PARAMS}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return sampling, program
