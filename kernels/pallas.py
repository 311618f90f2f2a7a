"""The `pallas` attention backend: the platform's Pallas kernel behind one interface (sgjax.kernels.pallas).

Chosen when the step is traced, from the default backend: the Triton kernel (pallas_gpu) on CUDA,
jax's ragged paged attention (pallas_tpu) on TPU. On CPU it runs the GPU kernel in interpret mode,
which is exact but slow: meant for tests, while CPU serving uses `cpu` (kernels/cpu.py) or `ref` (see
default_backend).
"""

from __future__ import annotations

import jax

from sgjax.kernels.metadata import AttentionMetadata


def default_backend(platform: str | None = None) -> str:
    """The attention backend the runner should use on `platform` ("cpu", "gpu"/"cuda", "tpu")."""
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "tpu"):
        return "pallas"
    from sgjax.kernels.cpu import available  # the native kernel, where it builds (kernels/cpu.py)

    return "cpu" if available() else "ref"


def pallas_attention(
    q, k, v, pool, layer, meta: AttentionMetadata, *, sm_scale: float, platform: str | None = None, **config
):
    """Backend signature; `config` goes to the platform's kernel (block sizes, splits)."""
    platform = platform or jax.default_backend()
    if platform == "tpu":
        from sgjax.kernels.pallas_tpu import pallas_tpu_attention  # imports only what the platform needs

        return pallas_tpu_attention(q, k, v, pool, layer, meta, sm_scale=sm_scale, **config)
    from sgjax.kernels.pallas_gpu import pallas_gpu_attention

    return pallas_gpu_attention(
        q, k, v, pool, layer, meta, sm_scale=sm_scale, interpret=platform not in ("gpu", "cuda"), **config
    )
