"""The public API of the language, with SGLang's names and signatures (`import sgjax as sgl`)."""

from __future__ import annotations

import inspect
from typing import Callable

from sgjax.engine.params import OPENAI_NAMES
from sgjax.lang.backend.base import Backend
from sgjax.lang.choices import ChoicesMethod, token_length_normalized
from sgjax.lang.global_config import global_config
from sgjax.lang.ir import GEN_PARAMS, ExprList, Image, RoleBegin, RoleEnd, Select, SeparateReasoning, make_gen, role
from sgjax.lang.media import encode_image, sample_frames


# -- backends -----------------------------------------------------------------------------------------------
def as_backend(backend) -> Backend:
    """A Backend as is; an `sgjax.Engine` wrapped in the in-process EngineBackend."""
    if isinstance(backend, Backend):
        return backend
    from sgjax.engine.engine import Engine  # only once someone passes something that is not a Backend

    if isinstance(backend, Engine):
        from sgjax.lang.backend.engine import EngineBackend

        return EngineBackend(backend)
    raise TypeError(f"a backend must be an sgjax Backend or Engine, not {type(backend).__name__}")


def set_default_backend(backend) -> None:
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def _backend(backend) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if global_config.default_backend is None:
        raise RuntimeError("no backend: call sgl.set_default_backend(sgl.Runtime()) or pass backend=...")
    return global_config.default_backend


def flush_cache(backend=None) -> bool:
    return _backend(backend).flush_cache()


def get_server_info(backend=None) -> dict:
    return _backend(backend).get_server_info()


# -- programs -----------------------------------------------------------------------------------------------
def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None):
    """`@sgl.function` turns `def program(s, ...)` into a Function you can run, batch and trace.
    `num_api_spec_tokens=N`: API speculative execution, a gen's call continues N tokens past its stop and later
    gens are matched in that text (sgjax/lang/speculative.py)."""
    if func is not None:
        return Function(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)


def _split_run_kwargs(kwargs: dict) -> tuple[dict, dict]:
    """run(...)'s keyword arguments: sampling defaults (GEN_PARAMS names) vs the program's own arguments."""
    sampling = {k: v for k, v in kwargs.items() if k in GEN_PARAMS and v is not None}
    program = {k: v for k, v in kwargs.items() if k not in GEN_PARAMS}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return sampling, program


class Function:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(f"the first argument of an sgjax function must be `s` (the prompt state); "
                            f"{func.__name__} has {params[0].name if params else 'none'}")
        self.func = func
        self.name = func.__name__
        self.num_api_spec_tokens = num_api_spec_tokens
        self._check_spec()
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self.defaults = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}

    def bind(self, **kwargs) -> "Function":
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.name} has no argument(s) {sorted(unknown)}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _check_spec(self):
        n = self.num_api_spec_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_api_spec_tokens (API speculative execution) is a number of tokens >= 1, got {n!r}")

    def run(self, *args, stream: bool = False, backend=None, **kwargs):
        """Run the program once; returns its state (`state["x"]`, `state.text()`). Keyword arguments named like
        sampling parameters (max_new_tokens, temperature, stop, ...) are defaults for every gen."""
        from sgjax.lang.interpreter import run_program, running_program

        if stream and self.num_api_spec_tokens is not None:
            raise ValueError(f"{self.name}: API speculative execution (num_api_spec_tokens) reads later gens out of "
                             f"one whole reply, so the program cannot stream; run it with stream=False")
        sampling, program_kwargs = _split_run_kwargs(kwargs)
        caller = running_program()
        if caller is not None:  # called by a running program: its backend and sampling defaults, unless given
            backend = backend if backend is not None else caller.backend
            sampling = {**caller.defaults, **sampling}
        return run_program(self, _backend(backend), args, program_kwargs, sampling, stream=stream)

    def run_batch(self, batch_kwargs, *, backend=None, num_threads="auto", progress_bar: bool = False, **sampling):
        """Run the program once per argument dict (or tuple of positional arguments), in parallel threads."""
        from sgjax.lang.run import run_program_batch

        unknown = set(sampling) - set(GEN_PARAMS)
        if unknown:
            raise TypeError(f"run_batch: unknown argument(s) {sorted(unknown)}; program arguments go in batch_kwargs")
        batch = [kw if isinstance(kw, dict) else self._positional(kw) for kw in batch_kwargs]
        if not batch:
            return []
        defaults, _ = _split_run_kwargs(sampling)
        return run_program_batch(self, _backend(backend), batch, defaults, num_threads, progress_bar)

    def _positional(self, values) -> dict:
        if not isinstance(values, (list, tuple)) or len(values) > len(self.arg_names):
            raise TypeError(f"{self.name} takes {self.arg_names}; got {values!r}")
        return dict(zip(self.arg_names, values))

    def trace(self, *, backend=None, assume: dict | None = None, **kwargs):
        """Compiler mode: the program's graph, with the given arguments fixed and the others abstract."""
        from sgjax.lang.tracer import trace_program

        backend = as_backend(backend) if backend is not None else global_config.default_backend
        return trace_program(self, backend, kwargs, assume)

    def compile(self, *, backend=None, **kwargs):
        """Compiler mode: trace the program once (the given arguments fixed, the others abstract) into its graph
        and return a CompiledFunction that runs the graph (`run`, `run_batch`, `print_graph`); a program whose
        control flow depends on generated values raises TracingError here."""
        from sgjax.lang.compiler import CompiledFunction

        return CompiledFunction(self, self.trace(backend=backend, **kwargs))

    def cache(self, backend=None) -> str:
        """Cache the program's constant prefix on the backend (run_batch does this by itself)."""
        from sgjax.lang.tracer import trace_program

        backend = _backend(backend)
        prefix = trace_program(self, backend, prefix_only=True).prefix()
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    def __call__(self, *args, **kwargs):
        from sgjax.lang.tracer import current_trace, trace_call

        if current_trace() is not None:  # called by a program being traced: trace the callee too
            return trace_call(self, args, kwargs)
        return self.run(*args, **kwargs)

    def __repr__(self):
        return f"sgjax.function({self.name})"


# -- expressions --------------------------------------------------------------------------------------------
_SGLANG_NAME = {theirs: ours for ours, (theirs, _) in OPENAI_NAMES.items() if theirs != ours}


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None, stop=None,
        stop_token_ids=None, temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None, dtype=None, choices=None,
        choices_method: ChoicesMethod | None = None, regex: str | None = None, json_schema=None, *,
        return_text_in_logprobs: bool | None = None, n: int | None = None, stop_regex=None):
    """Generate text into variable `name` (`s[name]`) and append it to the prompt. With `choices`, a select.
    `return_logprob` / `top_logprobs_num` / `return_text_in_logprobs` put the runtime's logprobs
    (`input_token_logprobs`, `output_token_logprobs`, `*_top_logprobs`: [logprob, token_id, text] entries) in the
    variable's meta info (`s.get_meta_info(name)`). `stop_regex`: Python regexes that stop the gen once the output
    matches one (SGLang's; the text keeps the match). SGLang's `n` exists for its signature: n > 1 is refused (one
    value per gen)."""
    if n is not None and n != 1:
        raise ValueError(f"gen: n={n!r} is not supported (a gen has one value); fork the state n times instead")
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    # gen's sampling arguments carry the OpenAI API's names (max_tokens, min_tokens): SGLang's names from the table
    sampling = dict(max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
                    stop_regex=stop_regex or None,
                    temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
                    presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos)
    return make_gen(name, dtype=dtype, regex=regex, json_schema=json_schema,
                    **{_SGLANG_NAME.get(k, k): v for k, v in sampling.items()},
                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs)


def gen_int(name: str | None = None, **kwargs):
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs):
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices=None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized):
    """Append the most likely of `choices` (scored with prompt logprobs) and store it in `s[name]`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select needs a non-empty list of non-empty strings, got {choices!r}")
    if temperature:
        raise ValueError("select picks the best-scoring choice; temperature > 0 is not supported")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"choices_method must be one of sgl.token_length_normalized, sgl.greedy_token_selection, "
                        f"sgl.unconditional_likelihood_normalized (or a ChoicesSamplingMethod); got {choices_method!r}")
    return Select(name, tuple(choices), choices_method)


def separate_reasoning(expr=None, model_type: str | None = None) -> ExprList:
    """`expr` (a named gen or select, or a list of them), then split each value's reasoning (`<think>...</think>`)
    from its answer: `s[name]` is the answer (also in the text, in place of the whole value) and
    `s[name + "_reasoning_content"]` the reasoning. `model_type` is SGLang's reasoning-parser name ("deepseek-r1":
    everything before </think> is reasoning; "qwen3": only a <think> block is); None: only a <think> block, so on a
    model that never writes one the reasoning is empty (sgjax/lang/reasoning.py)."""
    if expr is None:
        raise ValueError("separate_reasoning needs an expression (a named gen or select)")
    return ExprList.of(expr, SeparateReasoning(model_type, expr))


def image(image) -> Image:
    """An image in the prompt: a file path, http(s) URL, bytes, data URI, PIL image or uint8 array [H, W, 3].
    The text gets the chat template's image token; the image travels to the backend beside the text (SGLang's
    image_data) or, for a chat API, as an image part of the message."""
    return Image((encode_image(image),))


def video(video, num_frames: int) -> Image:
    """`num_frames` evenly spaced frames of a video (a [F, H, W, 3] uint8 array, a list of images, or a file read
    with imageio) as consecutive images."""
    return Image(tuple(sample_frames(video, num_frames)), kind="video")


def system(expr=None):
    return role("system", expr)


def user(expr=None):
    return role("user", expr)


def assistant(expr=None):
    return role("assistant", expr)


def system_begin():
    return RoleBegin("system")


def system_end():
    return RoleEnd("system")


def user_begin():
    return RoleBegin("user")


def user_end():
    return RoleEnd("user")


def assistant_begin():
    return RoleBegin("assistant")


def assistant_end():
    return RoleEnd("assistant")
