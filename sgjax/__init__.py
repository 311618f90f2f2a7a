"""sgjax: SGLang on JAX. The public surface is imported lazily so `import sgjax` stays cheap."""

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name):
    if name == "Engine":
        from sgjax.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from sgjax.engine.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sgjax' has no attribute {name!r}")
