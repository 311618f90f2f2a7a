"""The interpreter: every prompt state is a stream executed by its own worker thread.

`s += expr` puts the expression on the stream's queue and returns at once, like launching a kernel; the worker
executes expressions in order against the backend. `s["x"]` blocks until `x` exists. `s.fork(n)` is queued too:
when the worker reaches it, it sends the frontend hint (the prompt so far as a prefill-only request, so the
branches find it cached), copies its state into the n child streams and lets them start. `join` is queued on the
parent and waits for the children. A failing expression stops its stream; the error names the program line that
appended it and is raised where the program next uses the stream (`s["x"]`, `s.text()`, the run's result).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from sgjax.lang import speculative
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
    reasoning_names,
    variable_names,
)
from sgjax.lang.reasoning import split_reasoning
from sgjax.lang.state import ProgramError, ProgramState, ProgramStateGroup, _PromptAPI, call_site  # noqa: F401


# -- queued operations that are not program expressions ---------------------------------------------------
@dataclass(eq=False)
class _Fork:
    children: list
    hint: bool

    def __repr__(self):
        return f"fork({len(self.children)})"


@dataclass(eq=False)
class _Join:
    children: list
    mode: str
    names: tuple  # the variables the children define, gathered into lists on the parent

    def __repr__(self):
        return f"join({self.mode!r})"


@dataclass(eq=False)
class _ReadVar:
    """Append another stream's variable once it exists (a compiled graph's variable node; compiler.py)."""

    source: "StreamExecutor"
    name: str

    def __repr__(self):
        return f"variable({self.name!r})"


# Meta info lists a stream chunk carries whole so far; text_async_iter(return_meta_data=True) gives each chunk its
# new entries, as SGLang's stream does (with `output_token_logprobs_length`, the count so far).
class StreamExecutor:
    def __init__(
        self,
        backend,
        defaults: dict,
        stream: bool = False,
        root: "StreamExecutor | None" = None,
        num_api_spec_tokens: int | None = None,
    ):
        self.backend = backend
        self.defaults = defaults  # the run's sampling parameters; a gen's own override them
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens  # API speculative execution (speculative.py); None: off
        self.spec_reply: speculative.Reply | None = None  # the last speculative call's reply
        self.chat_template = backend.get_chat_template()
        self.root = root or self
        self.text_ = ""
        self.messages_: list[dict] = []
        self.images_: list[str] = []  # every image in the prompt, in order (base64 or URL; sgjax.lang.media)
        self._message_images: list[tuple[int, str]] = []  # (offset in the current message, image) for chat APIs
        self.cur_role: str | None = None
        self.role_begin_pos = 0
        self.variables: dict = {}
        self.meta_info: dict = {}
        self.fork_start = 0  # where a child's own text begins
        self.hint_meta: dict | None = None  # meta info of the frontend hint this stream sent at its last fork
        self.error_: BaseException | None = None
        self._events: dict[str, threading.Event] = {}  # the latest definition of each variable; set when final
        self._item_events: dict[str, threading.Event] = {}  # the events of the expression being executed
        self._partial: dict[str, str] = {}  # streaming gens: the text so far
        self._partial_meta: dict[str, dict] = {}  # streaming gens: the meta info so far
        self._spans: dict[str, tuple[int, int]] = {}  # where each gen's / select's latest value is in the text
        self._held: set[str] = set()  # names the expression being executed redefines later (separate_reasoning)
        self._raw: dict[str, tuple] = {}  # their first (value, meta), until the separate_reasoning runs
        self._scopes: dict[str, int] = {}
        self._descendants: list[StreamExecutor] = []
        self._ended = False
        self._ready = threading.Event()  # a child starts when its parent reaches the fork
        self._finished = threading.Event()
        self._changed = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        if root is None:
            self._ready.set()
        self._worker = threading.Thread(target=self._work, name="sgjax-stream", daemon=True)
        self._worker.start()

    # -- called from the program's thread -----------------------------------------------------------------
    def submit(self, expr, where: str, names=None) -> None:
        # One event per definition: a reader waits for the latest definition queued before its read.
        events = {name: threading.Event() for name in (variable_names(expr) if names is None else names)}
        self._events.update(events)
        self._queue.put((expr, where, events))
        if not global_config.enable_parallelism:
            self._queue.join()

    def get_var(self, name: str):
        event = self._events.get(name)
        if event is not None:
            event.wait()
        else:
            self._ready.wait()  # a child sees its parent's variables from the fork point on
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"no variable {name!r} in this program state; it has {sorted(self.variables)}")

    def set_var(self, name: str, value) -> None:
        self.variables[name] = value

    def fork(self, size: int, hint: bool, where: str) -> list["StreamExecutor"]:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork takes a number of branches >= 1, got {size!r}")
        children = [
            StreamExecutor(
                self.backend, self.defaults, self.stream, root=self.root, num_api_spec_tokens=self.num_api_spec_tokens
            )
            for _ in range(size)
        ]
        self.root._descendants.extend(children)
        self.submit(_Fork(children, hint), where)
        return children

    def join(self, children: list["StreamExecutor"], mode: str, where: str) -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        names = tuple(dict.fromkeys(n for c in children for n in c._events)) if mode == "gather_variable" else ()
        self.submit(_Join(children, mode, names), where, names)

    def sync(self) -> None:
        """Wait until everything queued so far ran, on this stream and (for a program's root) its forks."""
        self._queue.join()
        if self.root is self:
            for child in list(self._descendants):
                child._queue.join()

    def end(self) -> None:
        """No more expressions will come: the worker exits once the queue is drained."""
        if not self._ended:
            self._ended = True
            self._queue.put(None)
        if self.root is self:
            for child in list(self._descendants):
                child.end()

    def fail_from_program(self, error: BaseException) -> None:
        """The program's own code raised (streaming runs, where nobody else would see it)."""
        if self.error_ is None:
            self.error_ = error
        self._release_waiters()

    def stream_view(self, var_name: str | None) -> tuple[str, bool, dict | None]:
        """(text so far, done, meta info so far) for streaming: the whole prompt, or one variable. Call it holding
        `_changed`, under which a streaming gen updates its text and meta together."""
        if var_name is None:
            return self.text_, self._finished.is_set(), None
        event = self._events.get(var_name)
        final = event is not None and event.is_set()
        if final:
            return str(self.variables.get(var_name, "")), True, self.meta_info.get(var_name)
        return self._partial.get(var_name, ""), self._finished.is_set(), self._partial_meta.get(var_name)

    # -- the worker ---------------------------------------------------------------------------------------
    def _work(self) -> None:
        self._ready.wait()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    break
                expr, where, self._item_events = item
                self._held = reasoning_names(expr)
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except Exception as e:
                        self._fail(e, expr, where)
                if self.error_ is not None:
                    self._skip(expr)
            finally:
                self._queue.task_done()
                self._notify()
        self._finished.set()
        self._notify()

    def _fail(self, e: Exception, expr, where: str) -> None:
        if isinstance(e, ProgramError):  # from a child at a join: it already names its line
            self.error_ = e
        else:
            self.error_ = ProgramError(f"{where}: {expr!r} failed: {type(e).__name__}: {e}")
            self.error_.__cause__ = e
        self._release_waiters()

    def _skip(self, expr) -> None:
        """After a failure: wake the readers of what this expression would have defined."""
        for event in self._item_events.values():
            event.set()
        if isinstance(expr, _Fork):  # the children never get a state to start from
            for child in expr.children:
                if not child._ready.is_set():
                    child.fail_from_program(self.error_)
                    child._ready.set()
        if isinstance(expr, _Join):
            for child in expr.children:
                child.end()

    def _release_waiters(self) -> None:
        for event in list(self._events.values()):
            event.set()
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _execute(self, expr) -> None:
        if isinstance(expr, Constant):
            self._fill(expr.text)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            decision = self.backend.select(
                self._prompt(f"select({expr.name!r})"), list(expr.choices), expr.method, **self._media()
            )
            start = len(self.text_)
            self._fill(decision.decision)
            self._set(expr.name, decision.decision, decision.meta_info, start)
        elif isinstance(expr, Image):
            self._image(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._scopes:
                raise ValueError(f"var scope {expr.name!r} ends without a beginning")
            self._set(expr.name, self.text_[self._scopes.pop(expr.name) :], None)
        elif isinstance(expr, _Fork):
            self._fork(expr)
        elif isinstance(expr, _Join):
            self._join(expr)
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        elif isinstance(expr, _ReadVar):
            self._fill(str(expr.source.get_var(expr.name)))
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _fill(self, text: str) -> None:
        with self._changed:
            self.text_ += text
            self._changed.notify_all()

    def _set(self, name: str | None, value, meta, start: int | None = None) -> None:
        """Define a variable; `start`: where its value begins in the text (a gen's or select's, which ends the
        text)."""
        if name is None:
            return
        if start is not None:
            self._spans[name] = (start, len(self.text_))
        if name in self._held:  # a separate_reasoning after it gives the final value: not readable before that
            self._raw[name] = (value, meta)
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        event = self._item_events.get(name)
        if event is not None:
            event.set()

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        """Split each value into its reasoning and its answer (reasoning.py); the answer replaces the value in the
        text, so the message and later prompts hold only the answer. A streamed value stays in the text as it was
        streamed (readers have seen it): only the variables change."""
        for name in expr.names():
            value, meta = self._raw.pop(name) if name in self._raw else (self.variables[name], self.meta_info[name])
            reasoning, answer = split_reasoning(str(value), expr.model_type)
            start, end = self._spans[name]
            if not self.stream and self.text_[start:end] == value:
                with self._changed:
                    self.text_ = self.text_[:start] + answer + self.text_[end:]
                self._spans[name] = (start, start + len(answer))
            self._held.discard(name)
            self._set(name, answer, meta)
            self._set(expr.process_name_for_reasoning(name), reasoning, None)

    def _gen(self, gen: Gen) -> None:
        params = {**self.defaults, **gen.params}
        if self.images_ and not self.backend.is_chat_model:  # a chat API gets them inside the messages
            params["image_data"] = list(self.images_)
        extra_stops = [s for s in self.chat_template.stop_str if s not in (params.get("stop") or ())]
        if extra_stops:
            params["stop"] = list(params.get("stop") or ()) + extra_stops
        start = len(self.text_)
        if self.stream:
            value, meta = "", {}
            for piece, meta in self.backend.generate_stream(self._prompt(repr(gen)), params):
                value += piece
                with self._changed:  # the text and its meta info change together for stream readers
                    if gen.name is not None:
                        self._partial[gen.name], self._partial_meta[gen.name] = value, meta
                    self.text_ += piece
                    self._changed.notify_all()
        else:
            if self.num_api_spec_tokens and speculative.speculable(params):
                value, meta = self._gen_speculative(gen, params)
            else:
                value, meta = self.backend.generate(self._prompt(repr(gen)), params)
            self._fill(value)
        self._set(gen.name, value, meta, start)

    def _prompt(self, what: str):
        """What the backend continues: the text, or for a chat model the finished messages, which it answers with
        a new assistant message; so the current assistant message must still be empty."""
        if not self.backend.is_chat_model:
            return self.text_
        if self.cur_role != "assistant":
            raise ValueError(
                f"{what}: a chat model answers with an assistant message, so gen and select must be "
                f"inside assistant(...); here the current role is {self.cur_role!r}"
            )
        if self.text_[self.role_begin_pos :]:
            raise ValueError(
                f"{what}: a chat model starts a new assistant message on every call, so gen and select "
                f"must come first in theirs; this one follows "
                f"{self.text_[self.role_begin_pos :][:60]!r}"
                + (
                    ""
                    if self.num_api_spec_tokens
                    else "; with @sgl.function(num_api_spec_tokens=N) "
                    "later gens of a message are matched in the reply to its first"
                )
            )
        return list(self.messages_)

    def _gen_speculative(self, gen: Gen, params: dict) -> tuple[str, dict]:
        """API speculative execution (speculative.py): answer from the last reply, else call, continuing past the
        gen's stop. A chat model's reply begins where the assistant message does, so it must repeat the message's
        fixed text; a completion model's begins here."""
        miss = None
        if self.spec_reply is not None:
            got = speculative.answer(self.spec_reply, self.text_, params)
            if isinstance(got, speculative.Answer):
                return got.value, {
                    "speculative": "hit",
                    "completion_tokens": got.tokens,
                    "finish_reason": got.finish_reason,
                    "miss": None,
                }
            miss = got
        if self.backend.is_chat_model:
            if self.cur_role != "assistant":
                self._prompt(repr(gen))  # raises: not in an assistant message
            anchor, prompt = self.role_begin_pos, list(self.messages_)
        else:
            anchor, prompt = len(self.text_), self.text_
        call = speculative.call_params(params, self.num_api_spec_tokens)
        text, meta, ends = self.backend.speculate(prompt, call)
        self.spec_reply = speculative.make_reply(anchor, text, meta, ends, call)
        got = speculative.answer(self.spec_reply, self.text_, params)
        if isinstance(got, speculative.Answer):
            return got.value, {
                "speculative": "call",
                "completion_tokens": got.tokens,
                "finish_reason": got.finish_reason,
                "miss": miss,
                "call": {**meta, "text": text},
            }
        self.spec_reply = None
        # The reply cannot answer (it does not repeat a chat message's fixed text, or its end is unknown): the
        # gen's own call, where there is one.
        value, meta = self.backend.generate(self._prompt(f"{gen!r} (speculation failed: {got})"), params)
        return value, {**meta, "speculative": "fallback", "miss": got}

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}; roles do not nest")
        template = self.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt:
            self._role_begin("system")  # what the model's template puts before a conversation without one
            self._fill(template.default_system_prompt)
            self._role_end("system")
        self._fill(template.get_prefix_and_suffix(role, self.messages_)[0])
        self.cur_role, self.role_begin_pos = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end() without {role}_begin() (the current role is {self.cur_role!r})")
        content = self.text_[self.role_begin_pos :]
        if self._message_images:
            content = _content_parts(content, self._message_images, self.chat_template.image_token)
            self._message_images = []
        suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)[1]
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self._fill(suffix)

    def _image(self, expr: Image) -> None:
        for data in expr.data:
            if self.cur_role is not None:
                self._message_images.append((len(self.text_) - self.role_begin_pos, data))
            self.images_.append(data)
            self._fill(self.chat_template.image_token)

    def _media(self) -> dict:
        """The prompt's images for a text backend's select and hint (a chat API gets them inside the messages);
        empty without images, so backends that take none keep their signatures."""
        return {"images": list(self.images_)} if self.images_ and not self.backend.is_chat_model else {}

    def _fork(self, op: _Fork) -> None:
        if op.hint and self.text_:
            self.hint_meta = self.backend.cache_prefix(self.text_, **self._media())
        for child in op.children:
            child.text_, child.fork_start = self.text_, len(self.text_)
            child.messages_ = list(self.messages_)
            child.images_, child._message_images = list(self.images_), list(self._message_images)
            child.cur_role, child.role_begin_pos = self.cur_role, self.role_begin_pos
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child.spec_reply = self.spec_reply
            child._ready.set()

    def _join(self, op: _Join) -> None:
        for child in op.children:
            child._queue.join()
            if child.error_ is not None:
                raise child.error_
        if op.mode == "concate_and_append":
            self._fill("".join(c.text_[c.fork_start :] for c in op.children))
        for name in op.names:
            values = [c.variables[name] for c in op.children if name in c.variables]
            self._set(name, values, [c.meta_info.get(name) for c in op.children if name in c.variables])
        for child in op.children:
            child.end()


# -- running programs ---------------------------------------------------------------------------------------
def run_program(
    function, backend, args: tuple, kwargs: dict, defaults: dict, stream: bool = False, sync: bool = False
) -> ProgramState:
    executor = StreamExecutor(backend, defaults, stream, num_api_spec_tokens=function.num_api_spec_tokens)
    state = ProgramState(executor)
    kwargs = {**function.bind_arguments, **kwargs}
    if stream:

        def body():
            try:
                _call(function, state, args, kwargs, sync)
            except BaseException as e:
                executor.fail_from_program(e)

        threading.Thread(target=body, name="sgjax-program", daemon=True).start()
        return state
    _call(function, state, args, kwargs, sync)
    return state


# The program running in this thread: an sgl function it calls (SGLang's multi-function programs) runs on the same
# backend with the same sampling defaults unless the call gives its own.
_running = threading.local()


def running_program() -> StreamExecutor | None:
    return getattr(_running, "executor", None)


def _call(function, state: ProgramState, args, kwargs, sync: bool) -> None:
    outer, _running.executor = running_program(), state.stream_executor
    try:
        state.ret_value = function.func(state, *args, **kwargs)
    finally:
        _running.executor = outer
        state.stream_executor.end()
    if sync:
        state.sync()


def _content_parts(text: str, images: list[tuple[int, str]], token: str) -> list[dict]:
    """A message with images in OpenAI's form: text parts around image_url parts (the image tokens dropped)."""
    from sgjax.lang.media import data_url

    parts, start = [], 0
    for offset, data in images:
        if text[start:offset]:
            parts.append({"type": "text", "text": text[start:offset]})
        parts.append({"type": "image_url", "image_url": {"url": data_url(data)}})
        start = offset + len(token)
    if text[start:]:
        parts.append({"type": "text", "text": text[start:]})
    return parts
