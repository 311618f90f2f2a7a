"""Measured ceilings and roofline arithmetic shared by the GPU benchmarks.

The ceilings are measured in the same run (METHOD.md): a large device-to-device copy (bytes read +
written) and a large bf16 matmul on random data, each the median of many timed repetitions.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def time_fn(fn, *args, warmup: int = 3, iters: int = 20, per_sync: int = 5) -> float:
    """Median seconds per call of fn(*args), over `iters` groups of `per_sync` back-to-back calls.

    Calls within a group are queued without waiting, so the host-sync latency is paid once per group
    and does not inflate short kernels (the device executes the queued calls back to back).
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        for _ in range(per_sync - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) / per_sync)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device copy, counting bytes read plus bytes written; rotates two buffers past L2."""
    n = nbytes // 4
    xs = [jax.random.normal(jax.random.PRNGKey(i), (n,), jnp.float32) for i in range(2)]
    copy = jax.jit(lambda a, b: (a * 1.0001, b * 1.0001))  # two buffers per call: together well past L2
    return 2 * 2 * n * 4 / time_fn(copy, xs[0], xs[1], iters=10)


def matmul_rate(n: int = 8192, dtype=jnp.bfloat16) -> float:
    """FLOP/s of an n x n x n matmul of `dtype` operands (bf16, or e4m3 for fp8 GEMMs) with fp32 accumulation on
    random data; the second operand [n, n] is contracted on its last axis, the layout fp8 GEMMs take."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16).astype(dtype)
    mm = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(
            jnp.bfloat16
        )
    )
    return 2 * n**3 / time_fn(mm, a, b, iters=20)


def roofline(seconds: float, bytes_moved: float, flops: float, bandwidth: float, rate: float) -> dict:
    return {
        "ms": seconds * 1e3,
        "gb_per_s": bytes_moved / seconds / 1e9,
        "bw_ratio": bytes_moved / seconds / bandwidth,
        "tflop_per_s": flops / seconds / 1e12,
        "flop_ratio": flops / seconds / rate,
        "roofline_ms": max(bytes_moved / bandwidth, flops / rate) * 1e3,
        "roofline_ratio": max(bytes_moved / bandwidth, flops / rate) / seconds,
    }
