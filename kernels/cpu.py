"""The CPU's native kernels, in C++ called through XLA's FFI: the `cpu` attention backend (kernels/cpu_attention.cc)
and every matrix product of a step on one CPU (kernels/cpu_matmul.cc, the step plan's matmul "native").

XLA's CPU runs the `ref` backend's gathers and tiny batched dots far from the memory bound (docs/journal/
engine-cpu.md). The attention reads each row's pages in place, only the keys the row sees, with an online softmax.
The products read matrices packed in panels (kernels/cpu_pack.py) with the CPU's dot-product instructions, a
stacked layer's matrix in place, one arithmetic per output whatever the row count. Both share work with helper
threads that spin between a step's calls (kernels/cpu_parallel.h).

They are built on first use with the machine's C++ compiler (`$CXX`, else g++) for the machine it runs on
(-march=native) against the FFI headers jaxlib ships, into a cache directory (`$SGJAX_CACHE_DIR`, else
~/.cache/sgjax) keyed by the source, the flags, jaxlib's version and the CPU's flags, and registered once per
process. `available()` says whether that worked; the CPU's default attention backend is "cpu" then, "ref" otherwise,
and the step plan multiplies natively (engine/plan.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.kernels.metadata import AttentionMetadata
from sgjax.kernels.ref import row_request

log = logging.getLogger("sgjax.kernels")

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, name) for name in ("cpu_attention.cc", "cpu_matmul.cc"))
HEADERS = (os.path.join(_HERE, "cpu_parallel.h"),)
TARGETS = {"sgjax_paged_attention": "SgjaxPagedAttention", "sgjax_matmul": "SgjaxMatmul"}  # FFI name: symbol
TARGET = "sgjax_paged_attention"
FLAGS = ("-O3", "-mprefer-vector-width=512", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded (no compiler, a compile error, an unloadable library)."""


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cache_dir() -> str:
    return os.environ.get("SGJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sgjax")


@functools.lru_cache(maxsize=None)
def library_path(arch: str = "native") -> str:
    """The compiled library's path, compiling it if this machine has not yet (atomically: parallel test workers
    may build it at once). `arch` is gcc's -march: native for serving; the tests also build x86-64-v3 (AVX2) and
    x86-64 (no vectors) to run the kernel's other code paths."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise NativeBuildError("no C++ compiler (set CXX or install g++)")
    source = b"".join(open(path, "rb").read() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(
        b"\0".join(
            x.encode() if isinstance(x, str) else x
            for x in (
                source,
                " ".join(FLAGS),
                arch,
                compiler,
                importlib.metadata.version("jaxlib"),
                platform.machine(),
                " ".join(sorted(cpu_flags())),
            )
        )
    ).hexdigest()[:16]
    name = f"cpu_kernels-{arch}-{key}.so"
    # the cache, else the temporary directory where the cache cannot be written (a read-only home)
    for out_dir in (os.path.join(cache_dir(), "kernels"), os.path.join(tempfile.gettempdir(), "sgjax-kernels")):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            return path
        try:
            os.makedirs(out_dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        except OSError:
            continue
        os.close(fd)
        return _compile([compiler, *FLAGS, f"-march={arch}", f"-I{jax.ffi.include_dir()}", *SOURCES], tmp, path)
    raise NativeBuildError(f"no writable directory for the CPU kernels' library ({cache_dir()}, the temp dir)")


def _compile(cmd: list[str], tmp: str, path: str) -> str:
    try:
        done = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a parallel build of the same key replaces it with the same bytes
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@functools.lru_cache(maxsize=None)
def register(arch: str = "native", target: str = TARGET) -> str:
    """Build (if needed), load and register the kernels; returns `target`'s FFI name for `arch`. NativeBuildError
    when they cannot be."""
    try:
        lib = ctypes.cdll.LoadLibrary(library_path(arch))
    except OSError as e:
        raise NativeBuildError(f"cannot load the CPU kernels' library: {e}") from e
    names = {}
    for name, symbol in TARGETS.items():
        names[name] = name if arch == "native" else f"{name}_{arch.replace('-', '_')}"
        jax.ffi.register_ffi_target(names[name], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return names[target]


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the native kernel is usable here (logged once when not)."""
    try:
        register()
        return True
    except NativeBuildError as e:
        log.warning("native CPU attention unavailable, using the ref backend: %s", e)
        return False


def row_keys(meta: AttentionMetadata, num_rows: int, window=0):
    """Per query row: its request (clipped), and the keys it sees, [first, seen): causal up to its own position,
    inside its sliding window (0: none; an int or a traced int32), none for a padding row."""
    req, valid = row_request(meta.cu_q_lens, num_rows)
    q_len = meta.cu_q_lens[req + 1] - meta.cu_q_lens[req]
    q_pos = meta.kv_lens[req] - q_len + (jnp.arange(num_rows) - meta.cu_q_lens[req])
    seen = jnp.where(valid, jnp.minimum(meta.kv_lens[req], q_pos + 1), 0)
    if isinstance(window, int) and window == 0:
        first = jnp.zeros_like(seen)
    else:
        first = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)
    return req.astype(jnp.int32), first.astype(jnp.int32), seen.astype(jnp.int32)


def cpu_attention(
    q,
    k,
    v,
    pool,
    layer,
    meta: AttentionMetadata,
    *,
    sm_scale: float,
    window=0,
    softcap: float | None = None,
    arch: str = "native",
):
    """Backend signature (kernels/__init__.py), the `ref` backend's semantics."""
    target = register(arch)
    req, first, seen = row_keys(meta, q.shape[0], window)
    # the kernel writes k / v into the pool itself, in place (the pool is aliased to its second result): XLA's CPU
    # scatter converts a whole bfloat16 pool to float32 and back
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(pool.shape, pool.dtype))
    call = jax.ffi.ffi_call(target, shapes, vmap_method="sequential", input_output_aliases={4: 1})
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    out, pool = call(
        q32,
        k32,
        v32,
        meta.slot_mapping.astype(jnp.int32),
        pool,
        jnp.asarray(layer, jnp.int32),
        meta.page_table.astype(jnp.int32),
        req,
        first,
        seen,
        sm_scale=np.float32(sm_scale),
        softcap=np.float32(softcap or 0.0),
    )
    return out.astype(q.dtype), pool


def cpu_matmul(x, layer, matrices, *, arch: str = "native"):
    """x f32[M, K] against each PackedMatrix of `matrices` (stacked layers: `layer` picks one, read in place).
    Returns one f32[M, N] per matrix (kernels/cpu_matmul.cc); a row's result never depends on the other rows."""
    target = register(arch, "sgjax_matmul")
    operands, shapes = [], []
    for m in matrices:
        if m.k != x.shape[-1]:
            raise ValueError(f"cpu_matmul: x has K={x.shape[-1]}, a matrix K={m.k}")
        operands += [m.panels, m.params]
        shapes.append(jax.ShapeDtypeStruct((x.shape[0], m.n), jnp.float32))
    call = jax.ffi.ffi_call(target, shapes, vmap_method="sequential")
    return call(x.astype(jnp.float32), jnp.asarray(layer, jnp.int32), *operands)
