"""The backend a program runs on: one given per call, else the process's default (`sgl.set_default_backend`)."""

from __future__ import annotations

from sgjax.lang.backend.base import Backend
from sgjax.lang.backend.engine import EngineBackend
from sgjax.lang.global_config import global_config


def as_backend(backend) -> Backend:
    """A Backend as is; an `sgjax.Engine` wrapped in the in-process EngineBackend."""
    if isinstance(backend, Backend):
        return backend
    from sgjax.engine.engine import Engine  # jax and the model code: only for programs given an Engine

    if isinstance(backend, Engine):
        return EngineBackend(backend)
    raise TypeError(f"a backend must be an sgjax Backend or Engine, not {type(backend).__name__}")


def set_default_backend(backend) -> None:
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def resolve_backend(backend) -> Backend:
    """The backend a call names, else the default one."""
    if backend is not None:
        return as_backend(backend)
    if global_config.default_backend is None:
        raise RuntimeError("no backend: call sgl.set_default_backend(sgl.Runtime()) or pass backend=...")
    return global_config.default_backend
