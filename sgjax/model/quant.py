"""Quantized matrices: --weight-dtype int8, each output row of a matrix as int8 with a float32 scale (the row's
largest magnitude / 127; a GGUF Q8_0 file's matrices keep its scale per 32 weights of a row instead), and int4, each
group of 32 weights along a row as 4-bit steps above the group's minimum
(a float32 scale and minimum per group, as llama.cpp's Q4_1 blocks of 32). Activations, accumulation and
everything outside the matrices stay in the model's dtype. On a CPU the few-row products of decode read them
directly (kernels/cpu_matmul.cc: a quarter or an eighth of float32's bytes); elsewhere a product widens the matrix to
bf16 (every int8 is exact there and scales the output; an int4 weight, low + scale * u, is rounded to bf16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """q int8[..., N, K] ([out, in], as the kernels read rows) and scale f32[..., N] (one per output row), or
    f32[..., N, K / GROUP] (one per GROUP weights along a row: a GGUF Q8_0 file's blocks, kept by the loader);
    stacked layers lead both."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def grouped(self) -> bool:
        """A scale per GROUP of a row (Q8_0's), not per row."""
        return self.scale.ndim == self.q.ndim

    def rows(self, ids):
        """Rows `ids` of the matrix as float32 (an embedding lookup)."""
        return Int8Matrix(self.q[ids], self.scale[ids]).widened(jnp.float32)

    def widened(self, dtype=jnp.float32):
        """The matrix [..., N, K] in `dtype` (q * scale in float32 first)."""
        q = self.q.astype(jnp.float32)
        if not self.grouped:
            return (q * self.scale[..., None]).astype(dtype)
        groups = q.reshape(*q.shape[:-1], q.shape[-1] // GROUP, GROUP) * self.scale[..., None]
        return groups.reshape(q.shape).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Matrix:
    """--weight-dtype fp8 (SGLang's --quantization fp8, weights only: w8a16): q float8_e4m3fn[..., N, K] ([out, in])
    and scale f32[..., N], one per output row (the row's largest magnitude / 448, e4m3's largest finite value), so
    w ~ q * scale. A product widens q to bf16 (every e4m3 value is exact there) and scales its output rows.

    A block-scaled checkpoint's matrix (weight_block_size [bn, bk], model/fp8_checkpoint.py) keeps its scales per
    K-group instead: scale f32[..., N, K / bk] (each row repeats its row block's scales; `grouped`), and a product
    widens the matrix with them."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def grouped(self) -> bool:
        """Scales per group of a row (a block-scaled checkpoint's), not per row."""
        return self.scale.ndim == self.q.ndim

    def rows(self, ids):
        return Fp8Matrix(self.q[ids], self.scale[ids]).widened(jnp.float32)

    def widened(self, dtype=jnp.float32):
        xp = np if isinstance(self.q, np.ndarray) else jnp
        q = self.q.astype(xp.float32)
        if not self.grouped:
            return (q * self.scale[..., None]).astype(dtype)
        groups = self.scale.shape[-1]
        out = q.reshape(*q.shape[:-1], groups, q.shape[-1] // groups) * self.scale[..., None]
        return out.reshape(q.shape).astype(dtype)


E4M3_MAX = 448.0  # float8_e4m3fn's largest finite magnitude


def quantize_rows_fp8(x):
    """Per-row (per-token) dynamic e4m3 of activations x [T, K]: (q, scale f32[T, 1]), scale the row's largest
    magnitude / 448 (rows of zeros: 1). A row's scale depends on that row alone, so outputs stay batch-invariant."""
    x32 = x.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / E4M3_MAX, 1.0)
    return jnp.clip(x32 / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn), scale


def w8a8_dot(h, w: Fp8Matrix, out_dtype):
    """h [T, K] @ w.T (w [N, K] e4m3) with h quantized per token to e4m3 too (w8a8, SGLang's fp8 on GPUs with fp8
    dots): both operands fp8 with float32 accumulation, which XLA gives cuBLASLt's fp8 GEMM on Hopper; the output
    scaled by each row's and each output channel's scale."""
    xq, xs = quantize_rows_fp8(h)
    out = jax.lax.dot_general(xq, w.q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * xs * w.scale).astype(out_dtype)


def quantize_fp8(w) -> Fp8Matrix:
    """Per-row e4m3 of w [..., N, K]: scale = the row's largest magnitude / 448 (rows of zeros: 1), q = w / scale
    rounded to nearest even; the clip keeps a rounding at the top inside the finite range. numpy in, numpy out."""
    host = isinstance(w, np.ndarray)
    xp = np if host else jnp
    w32 = w.astype(xp.float32)
    peak = xp.max(xp.abs(w32), axis=-1)
    scale = xp.where(peak > 0, peak / E4M3_MAX, 1.0).astype(xp.float32)
    q = xp.clip(w32 / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return Fp8Matrix(q, scale)


def is_quantized(w) -> bool:
    return isinstance(w, (Int8Matrix, Int4Matrix, Fp8Matrix))


def quantize(w) -> Int8Matrix:
    """Symmetric per-row int8 of w [..., N, K] (rows of zeros get scale 1, not 0/0). numpy in, numpy out."""
    host = isinstance(w, np.ndarray)
    xp = np if host else jnp
    w32 = w.astype(xp.float32)
    peak = xp.max(xp.abs(w32), axis=-1)
    scale = xp.where(peak > 0, peak / 127.0, 1.0).astype(xp.float32)
    q = xp.clip(xp.round(w32 / scale[..., None]), -127, 127).astype(xp.int8)
    return Int8Matrix(q, scale)


def dequantized(w, dtype=jnp.float32):
    return w.widened(dtype)


GROUP = 32  # weights along a row per int4 (scale, low) pair, or per grouped int8 scale
BLOCK = 64  # int4 weights per packed run of 32 bytes: byte j holds weight j (low nibble) and j + 32 (high)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Matrix:
    """q uint8[..., N, K / 2]: each weight as u in [0, 15], two a byte as BLOCK lays them out; scale f32[..., N,
    K / 32, 2]: per GROUP its (scale, low), the weight being low + scale * u (llama.cpp's Q4_1); [out, in]
    ([out, in]); stacked layers lead both. K must be a multiple of 64."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape[:-1] + (2 * self.q.shape[-1],)

    @property
    def dtype(self):
        return self.q.dtype

    def rows(self, ids):
        """Rows `ids` of the matrix as float32 (an embedding lookup)."""
        return Int4Matrix(self.q[ids], self.scale[ids]).widened(jnp.float32)

    def widened(self, dtype=jnp.float32):
        """The matrix [..., N, K] in `dtype` (low + scale * u in float32 first)."""
        q = self.q
        lead, half = q.shape[:-1], q.shape[-1]
        runs = q.reshape(*lead, half // (BLOCK // 2), BLOCK // 2)
        u = jnp.concatenate([runs & 0xF, runs >> 4], axis=-1).astype(jnp.float32)
        u = u.reshape(*lead, 2 * half // GROUP, GROUP)
        values = self.scale[..., 1:2] + self.scale[..., 0:1] * u
        return values.reshape(*lead, 2 * half).astype(dtype)


def quantize_int4(w) -> Int4Matrix:
    """Asymmetric int4 per GROUP of w [..., N, K] (K a multiple of BLOCK): scale = (max - min) / 15, low = min;
    numpy in, numpy out."""
    host = isinstance(w, np.ndarray)
    xp = np if host else jnp
    *lead, k = w.shape
    if k % BLOCK:
        raise ValueError(f"int4 matrices need rows of a multiple of {BLOCK} weights, got {k}")
    groups = w.astype(xp.float32).reshape(*lead, k // GROUP, GROUP)
    low, high = xp.min(groups, axis=-1), xp.max(groups, axis=-1)
    scale = xp.where(high > low, (high - low) / 15.0, 1.0).astype(xp.float32)
    u = xp.clip(xp.round((groups - low[..., None]) / scale[..., None]), 0, 15).astype(xp.uint8)
    u = u.reshape(*lead, k // BLOCK, BLOCK)
    packed = (u[..., : BLOCK // 2] | (u[..., BLOCK // 2 :] << 4)).astype(xp.uint8)
    return Int4Matrix(packed.reshape(*lead, k // 2), xp.stack([scale, low.astype(xp.float32)], axis=-1))


def int4_from_q4_1(blocks: np.ndarray) -> Int4Matrix:
    """A GGUF Q4_1 tensor's rows of blocks (uint8 [..., N, K / 32 * 20]: per 32 weights an fp16 step d and minimum
    m, then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31, each m + d * u) as an Int4Matrix
    holding the same weights: (scale, low) = (d, m), the nibbles repacked into runs of BLOCK. numpy in and out."""
    b = _blocks(blocks, 20, "Q4_1")
    pairs = np.stack(
        [b[..., 0:2].copy().view(np.float16)[..., 0], b[..., 2:4].copy().view(np.float16)[..., 0]], axis=-1
    ).astype(np.float32)
    return _int4_from_nibbles(b[..., 4:], pairs)


def int4_from_q4_0(blocks: np.ndarray) -> Int4Matrix:
    """A GGUF Q4_0 tensor's rows of blocks (uint8 [..., N, K / 32 * 18]: per 32 weights an fp16 step d, then 16
    bytes of nibbles as Q4_1's, each weight d * (u - 8)) as an Int4Matrix holding the same weights: (scale, low) =
    (d, -8 d), exact in float32. numpy in and out."""
    b = _blocks(blocks, 18, "Q4_0")
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return _int4_from_nibbles(b[..., 2:], np.stack([d, -8.0 * d], axis=-1))


def _blocks(blocks: np.ndarray, size: int, name: str) -> np.ndarray:
    """Rows of `size`-byte blocks as [..., N, groups, size] (an even number of groups: int4's runs are two)."""
    *lead, width = blocks.shape
    if width % size or (width // size) % 2:
        raise ValueError(f"{name} rows of {width} bytes are not an even number of {size}-byte blocks")
    return np.ascontiguousarray(blocks).reshape(*lead, width // size, size)


def _int4_from_nibbles(qs: np.ndarray, pairs: np.ndarray) -> Int4Matrix:
    """[..., groups, 16] bytes (a group's weights 0-15 in the low nibbles, 16-31 in the high) and its (scale, low)
    pairs as an Int4Matrix: the nibbles repacked into runs of BLOCK."""
    *lead, groups, _ = qs.shape
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., groups, 32]: the group's weights in order
    runs = u.reshape(*lead, groups // 2, BLOCK)
    packed = (runs[..., : BLOCK // 2] | (runs[..., BLOCK // 2 :] << 4)).astype(np.uint8)
    return Int4Matrix(packed.reshape(*lead, groups * GROUP // 2), pairs)


def int8_from_q8_0(blocks: np.ndarray) -> Int8Matrix:
    """A GGUF Q8_0 tensor's rows of blocks (uint8 [..., N, K / 32 * 34]: per 32 weights an fp16 scale d, then 32
    int8 q, each weight d * q) as a grouped Int8Matrix holding the same weights. numpy in and out."""
    *lead, width = blocks.shape
    if width % 34:
        raise ValueError(f"Q8_0 rows of {width} bytes are not whole 34-byte blocks")
    b = np.ascontiguousarray(blocks).reshape(*lead, width // 34, 34)
    scale = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(*lead, width // 34 * GROUP)
    return Int8Matrix(q, scale)
