"""sgjax: SGLang on JAX. The public surface is imported lazily so `import sgjax` stays cheap (no JAX until an
Engine is asked for); `import sgjax as sgl` runs SGLang programs."""

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
    "ProgramError": "sgjax.lang.interpreter",
    "ProgramState": "sgjax.lang.interpreter",
    "TracingError": "sgjax.lang.tracer",
    "ChoicesDecision": "sgjax.lang.choices",
    "token_length_normalized": "sgjax.lang.choices",
    "greedy_token_selection": "sgjax.lang.choices",
    "unconditional_likelihood_normalized": "sgjax.lang.choices",
}
_LAZY.update({name: "sgjax.lang.api" for name in (
    "function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant", "system_begin",
    "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end", "set_default_backend",
    "get_default_backend", "flush_cache", "get_server_info", "Function", "image", "video", "separate_reasoning")})

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgjax' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
