"""A program's state as its code sees it: `s += ...`, `s["x"]`, roles, `fork` / `join`, streaming views.

The methods only queue expressions on the state's stream executor (sgjax/lang/interpreter.py) or wait on it; the
tracer's states (sgjax/lang/tracer.py) share `_PromptAPI` and the fork group, so neither module imports the other.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING

from sgjax.lang.global_config import global_config
from sgjax.lang.ir import RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr, role

if TYPE_CHECKING:
    from sgjax.lang.interpreter import StreamExecutor

# the meta info keys whose lists grow with the output (a stream chunk carries only its new entries)
_INCREMENTAL_META = ("output_token_logprobs", "output_top_logprobs")


class ProgramError(RuntimeError):
    """An expression of a program failed; the message starts with the program line that appended it."""


_LANG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.lru_cache(maxsize=256)
def _inside_lang(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LANG_DIR) or filename.startswith("<frozen")


def call_site() -> str:
    """`file:line in function` of the nearest caller outside sgjax.lang (the program's own line)."""
    f = sys._getframe(1)
    while f is not None and _inside_lang(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<unknown>"
    path = f.f_code.co_filename
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return f"{path if rel.startswith('..') else rel}:{f.f_lineno} in {f.f_code.co_name}"


class _PromptAPI:
    """The sugar a prompt state offers on top of `+=` and `fork` (shared with the tracer's states)."""

    def _role(self, name: str, expr):
        if expr is not None:
            self += role(name, expr)
            return None
        return self._role_scope(name)

    @contextmanager
    def _role_scope(self, role: str):
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self += VarScopeBegin(name)
        yield
        self += VarScopeEnd(name)

    @contextmanager
    def copy(self):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()


class ProgramState(_PromptAPI):
    """The `s` of a program."""

    def __init__(self, executor: StreamExecutor):
        self.stream_executor = executor
        self.ret_value = None

    def __iadd__(self, other):
        if other is None:
            raise ValueError("tried to append None to a program state")
        self.stream_executor.submit(as_expr(other), call_site())
        return self

    def __getitem__(self, name):
        return self.stream_executor.get_var(name)

    def __setitem__(self, name, value):
        self.stream_executor.set_var(name, value)

    def __contains__(self, name):
        return name in self.stream_executor.variables

    def get_var(self, name):
        return self.stream_executor.get_var(name)

    def set_var(self, name, value):
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name):
        self.stream_executor.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        hint = size > 1 and global_config.enable_frontend_hint
        children = self.stream_executor.fork(size, hint, call_site())
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    def _join(self, states, mode: str) -> None:
        self.stream_executor.join([s.stream_executor for s in states], mode, call_site())

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self):
        self.sync()
        return self.stream_executor.error_

    def _raise_error(self) -> None:
        error = self.error()
        if error is not None:
            raise error

    def text(self) -> str:
        self._raise_error()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self._raise_error()
        return list(self.stream_executor.messages_)

    def text_iter(self, var_name: str | None = None):
        """The prompt's (or one variable's) new text as it is produced; needs run(stream=True) to be gradual."""
        for piece, _ in self._chunks(var_name):
            yield piece

    def _chunks(self, var_name: str | None):
        """(new text, meta info of the variable then) as the text grows."""
        exe = self.stream_executor
        if not exe.stream:
            if var_name is None:
                yield self.text(), None
            else:
                yield str(self.get_var(var_name)), self.get_meta_info(var_name)
            return
        pos = 0
        while True:
            with exe._changed:
                current, done, meta = exe.stream_view(var_name)
                while len(current) <= pos and not done:
                    exe._changed.wait()
                    current, done, meta = exe.stream_view(var_name)
            if len(current) > pos:
                yield current[pos:], meta
                pos = len(current)
            elif done:
                break
        if exe.error_ is not None:
            raise exe.error_

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False):
        """`text_iter` for asyncio (the waiting happens in a worker thread, the event loop stays free). With
        `return_meta_data`, each piece comes with the variable's meta info: the logprob lists hold that piece's
        new entries and `output_token_logprobs_length` the count so far (SGLang's streamed meta info)."""
        chunks, done = self._chunks(var_name), object()
        sent = 0
        while True:
            item = await asyncio.to_thread(next, chunks, done)
            if item is done:
                return
            piece, meta = item
            if not return_meta_data:
                yield piece
                continue
            meta = dict(meta or {})
            total = len(meta.get("output_token_logprobs") or ())
            for key in _INCREMENTAL_META:
                if meta.get(key) is not None:
                    meta[key] = list(meta[key][sent:])
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs_length"] = total
            sent = total
            yield piece, meta

    def __repr__(self):  # SGLang's form (its examples cut the text out of it: str(state)[len("ProgramState("):-1])
        self.sync()
        error = self.stream_executor.error_
        return f"ProgramState({self.stream_executor.text_}" + (f", error={error!r})" if error else ")")


class ProgramStateGroup:
    """The states `fork` returns; `join` waits for them and brings their results back to the parent."""

    def __init__(self, states: list, parent):
        self.states = states
        self.parent = parent

    def __getitem__(self, i):
        return self.states[i]

    def __setitem__(self, i, value):
        """`forks[i] += expr` (SGLang's idiom) appends to branch i and then assigns the same state back."""
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; append to one with forks[i] += ...")

    def __len__(self):
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: every variable the branches defined becomes a list on the parent;
        concate_and_append: the branches' new text is appended to the parent's prompt."""
        self.parent._join(self.states, mode)

    def __iadd__(self, other):
        for i, state in enumerate(self.states):
            if callable(other):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self
