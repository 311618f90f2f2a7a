"""Attention backends over the paged KV pool (installed as `sgjax.kernels`).

Backends: `ref` (pure jnp, exact, everywhere), `cpu` (kernels/cpu_attention.cc through XLA's FFI, the CPU's
default when it builds), `pallas` (GPU and TPU kernels). Every backend has the signature
    attend(q, k, v, pool, layer, meta: AttentionMetadata, *, sm_scale) -> (out, pool)
with q [T, Hq, D], k/v [T, Hkv, D] of the new tokens; it writes k/v into the pool and attends each
row to its request's cached and new tokens, causally.
"""


def _hand_the_name_over() -> None:
    """Imported as a top-level `kernels` (a checkout's root on sys.path: pytest, PYTHONPATH): that name belongs to
    the unrelated distribution transformers >= 5.25 imports. When it is installed, import it from everywhere but
    the root and leave it in sys.modules, which the import system returns in place of this module."""
    import importlib
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved, ours = sys.path[:], sys.modules.pop("kernels")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    finally:
        sys.path[:] = saved
        sys.modules.setdefault("kernels", ours)


if __name__ == "kernels":
    _hand_the_name_over()

import functools  # noqa: E402

from sgjax.kernels.cpu import cpu_attention  # noqa: E402
from sgjax.kernels.kv_pool import allocate_pool, pool_shape  # noqa: E402
from sgjax.kernels.metadata import AttentionMetadata  # noqa: E402
from sgjax.kernels.pallas import default_backend, pallas_attention  # noqa: E402
from sgjax.kernels.ref import ref_attention  # noqa: E402

BACKENDS = {
    "ref": ref_attention,
    "pallas": pallas_attention,
    "cpu": cpu_attention,
    # the pallas backend with its prefill kernel pinned (kernels/pallas_gpu.py): "auto" is mgpu on Hopper
    "pallas:triton": functools.partial(pallas_attention, prefill_kernel="triton"),
    "pallas:mgpu": functools.partial(pallas_attention, prefill_kernel="mgpu"),
}


def get_backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}") from None


__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "allocate_pool",
    "cpu_attention",
    "default_backend",
    "get_backend",
    "pallas_attention",
    "pool_shape",
    "ref_attention",
]
