"""sgjax: SGLang on JAX. The public surface is imported lazily so `import sgjax` stays cheap (no JAX until an
Engine is asked for); `import sgjax as sgl` runs SGLang programs."""

from typing import TYPE_CHECKING

# name -> module that defines it
_LAZY = {
    "Engine": "sgjax.engine.engine",
    "SamplingParams": "sgjax.engine.params",
    "Runtime": "sgjax.lang.backend.engine",
    "EngineBackend": "sgjax.lang.backend.engine",
    "Backend": "sgjax.lang.backend.base",
    "RuntimeEndpoint": "sgjax.lang.backend.runtime_endpoint",
    "OpenAI": "sgjax.lang.backend.openai",
    "global_config": "sgjax.lang.global_config",
    "ProgramError": "sgjax.lang.state",
    "ProgramState": "sgjax.lang.state",
    "TracingError": "sgjax.lang.tracer",
    "ChoicesDecision": "sgjax.lang.choices",
    "token_length_normalized": "sgjax.lang.choices",
    "greedy_token_selection": "sgjax.lang.choices",
    "unconditional_likelihood_normalized": "sgjax.lang.choices",
}
_LAZY.update(
    {
        name: "sgjax.lang.api"
        for name in (
            "function",
            "gen",
            "gen_int",
            "gen_string",
            "select",
            "system",
            "user",
            "assistant",
            "system_begin",
            "system_end",
            "user_begin",
            "user_end",
            "assistant_begin",
            "assistant_end",
            "set_default_backend",
            "get_default_backend",
            "flush_cache",
            "get_server_info",
            "Function",
            "image",
            "video",
            "separate_reasoning",
        )
    }
)

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # editors and type checkers resolve `sgl.gen` & co. here; at run time they load on first use
    from sgjax.engine.engine import Engine
    from sgjax.engine.params import SamplingParams
    from sgjax.lang.api import (
        Function,
        assistant,
        assistant_begin,
        assistant_end,
        flush_cache,
        function,
        gen,
        gen_int,
        gen_string,
        get_default_backend,
        get_server_info,
        image,
        select,
        separate_reasoning,
        set_default_backend,
        system,
        system_begin,
        system_end,
        user,
        user_begin,
        user_end,
        video,
    )
    from sgjax.lang.backend.base import Backend
    from sgjax.lang.backend.engine import EngineBackend, Runtime
    from sgjax.lang.backend.openai import OpenAI
    from sgjax.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sgjax.lang.choices import (
        ChoicesDecision,
        greedy_token_selection,
        token_length_normalized,
        unconditional_likelihood_normalized,
    )
    from sgjax.lang.global_config import global_config
    from sgjax.lang.state import ProgramError, ProgramState
    from sgjax.lang.tracer import TracingError


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgjax' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
