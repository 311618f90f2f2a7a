"""Compiler mode: run a program once on abstract arguments and record what it appends as a graph.

Nodes are the program's expressions (constant text, argument, gen, select, variable, fork, get_fork_item,
join), each in a stream (a prompt state: the program's own, or a fork branch). Edges are intra-stream (the
order within a stream) and inter-stream (a branch starts from its fork; a variable read in one stream comes
from a gen in another; a join waits for its branches). Role markers become constant text through the
backend's chat template, as they would when run.

Values unknown while tracing (abstract arguments, gen and select results) are `Symbol`s: strings holding a
marker, so that `"Essay: " + essay`, f-strings and `"\\n".join(...)` of branch results keep working and become
argument / variable nodes when appended. Anything that looks inside one (`==`, `if`, `len`, slicing, methods)
depends on data the trace does not have and raises `TracingError` naming the value and the program line;
`trace(assume={"name": value})` fixes a gen or select result to trace one branch of such a program.

The batch pre-cache traces only until the first non-constant node of the program's own stream: that constant
text is every run's common prefix, sent as one prefill-only request before the batch starts.

Each node also keeps the expressions that produced it (`Node.exprs`: a constant node's text pieces and role
markers, a gen's Gen, ...), so `Function.compile()` can run the graph itself (compiler.py). A program that calls
another sgl function while traced (SGLang's multi-function programs) records the callee in a stream of its own,
whose reads of the caller's variables are inter-stream edges. `graph.last_node.print_graph_dfs()` prints what the
program's last node depends on, as SGLang's tracer does.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from sgjax.lang.chat_template import PLAIN
from sgjax.lang.global_config import global_config
from sgjax.lang.ir import (
    Constant,
    ExprList,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    split_run_kwargs,
)
from sgjax.lang.state import ProgramStateGroup, _PromptAPI, call_site

_MARKER = re.compile("\x00sgjax(\\d+)\x00")


class TracingError(RuntimeError):
    """A program cannot be traced: its control flow or Python code depends on a value the trace does not have."""


class _StopTracing(BaseException):  # BaseException: a program's own `except Exception` must not swallow it
    pass


def _refuse(operation: str):
    def method(self, *args, **kwargs):
        raise TracingError(
            f"compiler mode: {object.__getattribute__(self, '_what')} is not known while tracing, "
            f"and the program uses it in `{operation}` at {call_site()}. Control flow or Python "
            f"code that depends on a generated value or an abstract argument cannot be traced; "
            f"give its value (trace(arg=...) for an argument, trace(assume={{name: value}}) for a "
            f"gen or select result) or run the program in interpreter mode."
        )

    return method


class Symbol(str):
    """A value unknown while tracing, usable only as text to append."""

    def __getattribute__(self, name):
        if name.startswith("__") or name == "_what":
            return object.__getattribute__(self, name)
        return _refuse(f".{name}(...)").__get__(self)

    __hash__ = str.__hash__


for _op in (
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__len__",
    "__iter__",
    "__contains__",
    "__getitem__",
    "__int__",
    "__float__",
    "__mod__",
    "__mul__",
    "__rmul__",
):
    setattr(Symbol, _op, _refuse(_op))


@dataclass
class Node:
    id: int
    kind: str  # constant | argument | gen | select | variable | fork | get_fork_item | join | separate_reasoning
    stream: int
    label: str
    prev: int | None = None  # the previous node of the same stream
    sources: tuple = ()  # nodes this one reads: a fork, a variable's gen, a join's branch ends
    where: str = ""
    exprs: list = field(default_factory=list, repr=False, compare=False)  # what running the node submits
    graph: "Graph | None" = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        label = self.label if self.kind != "constant" else _short(self.label)
        reads = f" <- {', '.join(f'%{s}' for s in self.sources)}" if self.sources else ""
        after = f"%{self.prev} + " if self.prev is not None else ""
        return f"%{self.id} = {after}{self.kind} {label}{reads}"

    def print_graph_dfs(self) -> str:
        """Every node this one depends on (previous nodes and reads, across streams), dependencies first, one
        line each, then this node: SGLang's `tracer.last_node.print_graph_dfs()`."""
        nodes = self.graph.nodes
        seen, order, stack = set(), [], [(self.id, False)]
        while stack:  # iterative post-order: a long program must not hit the recursion limit
            i, done = stack.pop()
            if done:
                order.append(i)
                continue
            if i in seen:
                continue
            seen.add(i)
            stack.append((i, True))
            n = nodes[i]
            deps = ([n.prev] if n.prev is not None else []) + list(n.sources)
            stack.extend((d, False) for d in reversed(deps) if d not in seen)
        return "".join(nodes[i].line() + "\n" for i in order)


@dataclass
class Graph:
    name: str
    nodes: list[Node]
    assume: dict = field(default_factory=dict)

    def __post_init__(self):
        for n in self.nodes:
            n.graph = self

    @property
    def last_node(self) -> Node | None:
        """The program's own stream's last node (SGLang's `tracer.last_node`)."""
        main = self.stream(0)
        return main[-1] if main else None

    def print_graph(self) -> None:
        print(self)

    @property
    def num_streams(self) -> int:
        return 1 + max((n.stream for n in self.nodes), default=0)

    def stream(self, i: int) -> list[Node]:
        return [n for n in self.nodes if n.stream == i]

    def kinds(self, stream: int) -> list[str]:
        return [n.kind for n in self.stream(stream)]

    def edges(self) -> list[tuple[int, int, str]]:
        """(from, to, "intra" | "inter")."""
        out = []
        for n in self.nodes:
            if n.prev is not None:
                out.append((n.prev, n.id, "intra"))
            for s in n.sources:
                out.append((s, n.id, "intra" if self.nodes[s].stream == n.stream else "inter"))
        return out

    def prefix(self) -> str:
        """The constant text the program's own stream starts with: the same in every run."""
        text = []
        for n in self.stream(0):
            if n.kind != "constant":
                break
            text.append(n.label)
        return "".join(text)

    def __str__(self):
        assumed = f" (assuming {', '.join(f'{k}={v!r}' for k, v in self.assume.items())})" if self.assume else ""
        lines = [f"{self.name}: {len(self.nodes)} nodes in {self.num_streams} streams{assumed}"]
        for i in range(self.num_streams):
            lines.append(f"stream {i}")
            for n in self.stream(i):
                lines.append("  " + n.line())
        return "\n".join(lines)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class _Trace:
    """What all streams of one trace share: the nodes, the symbols, the switches."""

    def __init__(self, chat_template, assume: dict, prefix_only: bool):
        self.chat_template = chat_template
        self.assume = assume
        self.prefix_only = prefix_only
        self.nodes: list[Node] = []
        self.symbols: dict[int, tuple[str, str, int | None]] = {}  # marker -> (kind, name, source node)
        self.streams = 0

    def new_stream(self) -> int:
        self.streams += 1
        return self.streams - 1

    def add(self, stream: int, kind: str, label: str, prev, sources=(), where="") -> Node:
        node = Node(len(self.nodes), kind, stream, label, prev, tuple(sources), where)
        self.nodes.append(node)
        return node

    def symbol(self, kind: str, name: str, source: int | None, what: str) -> Symbol:
        marker = len(self.symbols)
        self.symbols[marker] = (kind, name, source)
        value = Symbol(f"\x00sgjax{marker}\x00")
        object.__setattr__(value, "_what", what)
        return value


class TracerState(_PromptAPI):
    """The `s` of a traced program: records nodes instead of running them."""

    def __init__(self, trace: _Trace, stream: int, variables=None, messages=None):
        self._trace = trace
        self._stream = stream
        self._last: int | None = None
        self._vars = dict(variables or {})
        self._own_vars: list[str] = []  # defined in this stream (what a join gathers)
        self._messages: list[dict] = list(messages or [])  # the finished messages' roles (for the template)

    def __iadd__(self, other):
        if other is None:
            raise ValueError("tried to append None to a program state")
        self._add(as_expr(other), call_site())
        return self

    def __getitem__(self, name):
        if name in self._trace.assume:
            return self._trace.assume[name]
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} in this program state; it has {sorted(self._vars)}")
        return self._vars[name]

    def __setitem__(self, name, value):
        self._vars[name] = value

    def get_var(self, name):
        return self[name]

    def _refuse_text(self, *args, **kwargs):
        raise TracingError(f"compiler mode: the prompt text is not known while tracing ({call_site()})")

    text = messages = _refuse_text

    def sync(self):
        pass

    # -- recording --------------------------------------------------------------------------------------
    def _node(self, kind: str, label: str, where: str, sources=()) -> Node:
        if self._trace.prefix_only and self._stream == 0 and kind != "constant":
            raise _StopTracing()
        node = self._trace.add(self._stream, kind, label, self._last, sources, where)
        self._last = node.id
        return node

    def _define(self, name: str | None, node: Node, kind: str) -> None:
        if name is not None:
            self._vars[name] = self._trace.symbol("variable", name, node.id, f"s[{name!r}] ({kind} at {node.where})")
            self._own_vars.append(name)

    def _last_constant(self) -> Node | None:
        last = self._trace.nodes[self._last] if self._last is not None else None
        return last if last is not None and last.kind == "constant" else None

    def _constant(self, text: str, expr, where: str) -> None:
        """Constant text produced by `expr`: one node per run of constant text."""
        node = self._last_constant()
        if node is None:
            node = self._node("constant", text, where)
        else:
            node.label += text
        node.exprs.append(expr)

    def _attach(self, expr, where: str) -> None:
        """An expression that adds no text (a var scope, a role marker of an empty prefix) runs with the constant
        text around it."""
        self._constant("", expr, where)

    def _text(self, text: str, where: str, expr=None) -> None:
        """Text to append; `expr` (a role marker) is what produces it when the graph runs, else the text itself."""
        if expr is not None:
            self._constant(text, expr, where)
            return
        for i, piece in enumerate(_MARKER.split(text)):
            if i % 2 == 0:
                if piece:
                    self._constant(piece, Constant(piece), where)
            else:
                kind, name, source = self._trace.symbols[int(piece)]
                self._node(kind, name, where, sources=() if source is None else (source,))

    def _add(self, e, where: str) -> None:
        if isinstance(e, Constant):
            self._text(e.text, where)
        elif isinstance(e, ExprList):
            for item in e.items:
                self._add(item, where)
        elif isinstance(e, Gen):
            params = ", ".join(f"{k}={v!r}" for k, v in e.params.items())
            node = self._node("gen", f"{e.name}" + (f" ({params})" if params else ""), where)
            node.exprs.append(e)
            self._define(e.name, node, "gen")
        elif isinstance(e, Select):
            node = self._node("select", f"{e.name} {list(e.choices)} by {e.method!r}", where)
            node.exprs.append(e)
            self._define(e.name, node, "select")
        elif isinstance(e, Image):
            # not constant text: the KV of image tokens depends on the image, so the batch pre-cache stops here
            self._node(e.kind, repr(e), where).exprs.append(e)
        elif isinstance(e, RoleBegin):
            template = self._trace.chat_template
            if not self._messages and e.role != "system" and template.default_system_prompt:
                self._add(ExprList.of(RoleBegin("system"), template.default_system_prompt, RoleEnd("system")), where)
            self._text(template.get_prefix_and_suffix(e.role, self._messages)[0], where, e)
        elif isinstance(e, RoleEnd):
            suffix = self._trace.chat_template.get_prefix_and_suffix(e.role, self._messages)[1]
            self._messages.append({"role": e.role, "content": ""})
            self._text(suffix, where, e)
        elif isinstance(e, VarScopeBegin):
            self._attach(e, where)  # the scope's text is whatever runs until its end
        elif isinstance(e, VarScopeEnd):
            self._attach(e, where)
            self._define(e.name, self._trace.nodes[self._last], "var_scope")
        elif isinstance(e, SeparateReasoning):
            node = self._node("separate_reasoning", repr(e), where)
            node.exprs.append(e)
            for name in e.names():  # the answer and the reasoning now come from here
                self._define(name, node, "separate_reasoning")
                self._define(e.process_name_for_reasoning(name), node, "separate_reasoning")
        else:
            raise TypeError(f"cannot trace {e!r}")

    def fork(self, size: int = 1) -> ProgramStateGroup:
        fork = self._node("fork", str(size), call_site())
        states = []
        for i in range(size):
            child = TracerState(self._trace, self._trace.new_stream(), self._vars, self._messages)
            child._last = self._trace.add(child._stream, "get_fork_item", str(i), None, (fork.id,), fork.where).id
            states.append(child)
        return ProgramStateGroup(states, self)

    def _join(self, states, mode: str) -> None:
        self._node("join", mode, call_site(), sources=[s._last for s in states])
        if mode == "gather_variable":
            for name in dict.fromkeys(n for s in states for n in s._own_vars):
                self._vars[name] = [s._vars[name] for s in states if name in s._vars]


# -- entry points -------------------------------------------------------------------------------------------
_current = threading.local()  # the trace a program is being traced into, in this thread


def current_trace() -> _Trace | None:
    return getattr(_current, "trace", None)


def _arguments(trace: _Trace, function, known: dict) -> dict:
    unknown = set(known) - set(function.arg_names)
    if unknown:
        raise TypeError(f"{function.name} has no argument(s) {sorted(unknown)}; its arguments: {function.arg_names}")
    return {
        name: known[name] if name in known else trace.symbol("argument", name, None, f"argument {name!r}")
        for name in function.arg_names
    }


def trace_program(
    function, backend=None, concrete: dict | None = None, assume: dict | None = None, prefix_only: bool = False
) -> Graph:
    """Trace `function` with the arguments in `concrete` (plus its bound arguments and defaults) fixed and the
    others abstract."""
    template = backend.get_chat_template() if backend is not None else PLAIN
    trace = _Trace(template, dict(assume or {}), prefix_only)
    args = _arguments(trace, function, {**function.defaults, **function.bind_arguments, **(concrete or {})})
    state = TracerState(trace, trace.new_stream())
    outer, _current.trace = current_trace(), trace
    try:
        function.func(state, **args)
    except _StopTracing:
        pass
    finally:
        _current.trace = outer
    return Graph(function.name, trace.nodes, dict(assume or {}))


def trace_call(function, args: tuple, kwargs: dict) -> TracerState:
    """A traced program calls another sgl function: the callee is traced into a stream of its own (its state is
    what the call returns, so `branch["x"]` reads the callee's variable). Sampling keywords are not traced."""
    trace = current_trace()
    if len(args) > len(function.arg_names):
        raise TypeError(f"{function.name} takes {function.arg_names}; got {len(args)} positional arguments")
    _, program_kwargs = split_run_kwargs(kwargs)
    program_kwargs.pop("backend", None)
    known = {**function.defaults, **function.bind_arguments, **dict(zip(function.arg_names, args)), **program_kwargs}
    state = TracerState(trace, trace.new_stream())
    function.func(state, **_arguments(trace, function, known))
    return state


def _same(a, b) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:
        return False


def cache_common_prefix(function, backend, batch_kwargs: list[dict]) -> str:
    """Trace the program with the arguments every run shares fixed, and send its constant prefix as one
    prefill-only request. Returns the prefix (empty when too short or when the program cannot be traced)."""
    first = batch_kwargs[0]
    shared = {k: v for k, v in first.items() if all(k in kw and _same(kw[k], v) for kw in batch_kwargs[1:])}
    try:
        prefix = trace_program(function, backend, shared, prefix_only=True).prefix()
    except Exception:  # a program the tracer cannot follow still runs; it only misses the pre-cache
        return ""
    if len(prefix) < global_config.precache_min_chars:
        return ""
    backend.cache_prefix(prefix)
    return prefix
