"""`Function`, what `@sgl.function` makes of a program: run it, batch it, trace it, compile it, cache its prefix."""

from __future__ import annotations

import inspect
from typing import Callable

from sgjax.lang.backend.default import as_backend, resolve_backend
from sgjax.lang.compiler import CompiledFunction
from sgjax.lang.global_config import global_config
from sgjax.lang.interpreter import run_program, running_program
from sgjax.lang.ir import GEN_PARAMS, split_run_kwargs
from sgjax.lang.run import run_program_batch
from sgjax.lang.tracer import current_trace, trace_call, trace_program


class Function:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(
                f"the first argument of an sgjax function must be `s` (the prompt state); "
                f"{func.__name__} has {params[0].name if params else 'none'}"
            )
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
        if stream and self.num_api_spec_tokens is not None:
            raise ValueError(
                f"{self.name}: API speculative execution (num_api_spec_tokens) reads later gens out of "
                f"one whole reply, so the program cannot stream; run it with stream=False"
            )
        sampling, program_kwargs = split_run_kwargs(kwargs)
        caller = running_program()
        if caller is not None:  # called by a running program: its backend and sampling defaults, unless given
            backend = backend if backend is not None else caller.backend
            sampling = {**caller.defaults, **sampling}
        return run_program(self, resolve_backend(backend), args, program_kwargs, sampling, stream=stream)

    def run_batch(self, batch_kwargs, *, backend=None, num_threads="auto", progress_bar: bool = False, **sampling):
        """Run the program once per argument dict (or tuple of positional arguments), in parallel threads."""
        unknown = set(sampling) - set(GEN_PARAMS)
        if unknown:
            raise TypeError(f"run_batch: unknown argument(s) {sorted(unknown)}; program arguments go in batch_kwargs")
        batch = [kw if isinstance(kw, dict) else self._positional(kw) for kw in batch_kwargs]
        if not batch:
            return []
        defaults, _ = split_run_kwargs(sampling)
        return run_program_batch(self, resolve_backend(backend), batch, defaults, num_threads, progress_bar)

    def _positional(self, values) -> dict:
        if not isinstance(values, (list, tuple)) or len(values) > len(self.arg_names):
            raise TypeError(f"{self.name} takes {self.arg_names}; got {values!r}")
        return dict(zip(self.arg_names, values))

    def trace(self, *, backend=None, assume: dict | None = None, **kwargs):
        """Compiler mode: the program's graph, with the given arguments fixed and the others abstract."""
        backend = as_backend(backend) if backend is not None else global_config.default_backend
        return trace_program(self, backend, kwargs, assume)

    def compile(self, *, backend=None, **kwargs):
        """Compiler mode: trace the program once (the given arguments fixed, the others abstract) into its graph
        and return a CompiledFunction that runs the graph (`run`, `run_batch`, `print_graph`); a program whose
        control flow depends on generated values raises TracingError here."""
        return CompiledFunction(self, self.trace(backend=backend, **kwargs))

    def cache(self, backend=None) -> str:
        """Cache the program's constant prefix on the backend (run_batch does this by itself)."""
        backend = resolve_backend(backend)
        prefix = trace_program(self, backend, prefix_only=True).prefix()
        if prefix:
            backend.cache_prefix(prefix)
        return prefix

    def __call__(self, *args, **kwargs):
        if current_trace() is not None:  # called by a program being traced: trace the callee too
            return trace_call(self, args, kwargs)
        return self.run(*args, **kwargs)

    def __repr__(self):
        return f"sgjax.function({self.name})"


SglFunction = Function  # SGLang's name
