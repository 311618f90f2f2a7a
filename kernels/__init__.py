"""Attention backends over the paged KV pool (installed as `sgjax.kernels`).

Every backend has the signature
    attend(q, k, v, pool, layer, meta: AttentionMetadata, *, sm_scale) -> (out, pool)
with q [T, Hq, D], k/v [T, Hkv, D] of the new tokens; it writes k/v into the pool and attends each
row to its request's cached and new tokens, causally.
"""

from sgjax.kernels.kv_pool import allocate_pool, pool_shape
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.pallas import default_backend, pallas_attention
from sgjax.kernels.ref import ref_attention

import functools

BACKENDS = {"ref": ref_attention, "pallas": pallas_attention,
            # the pallas backend with its prefill kernel pinned (kernels/pallas_gpu.py): "auto" is mgpu on Hopper
            "pallas:triton": functools.partial(pallas_attention, prefill_kernel="triton"),
            "pallas:mgpu": functools.partial(pallas_attention, prefill_kernel="mgpu")}


def get_backend(name: str):
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}") from None


__all__ = ["AttentionMetadata", "BACKENDS", "allocate_pool", "default_backend", "get_backend", "pallas_attention",
           "pool_shape", "ref_attention"]
