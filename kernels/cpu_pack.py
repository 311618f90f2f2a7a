"""Matrices packed for the CPU's native products (kernels/cpu_matmul.cc): panels of 16 output rows, so that one
vector holds one value of each of a panel's rows and every x row is a broadcast.

A `PackedMatrix` replaces a [..., N, K] matrix leaf of the weights when the step plan multiplies natively
(engine/plan.py); stacked layers keep their leading axis, and the kernel reads one layer in place. `rows(ids)` reads
rows back (an embedding lookup of a tied head). The layouts, per panel of 16 rows (n = 16 p + l):
  float32  [K, 16]                      w[n, k] at [k, l]
  bfloat16 [K / 2, 16, 2]               w[n, k] at [k // 2, l, k % 2]
  int4     u8 [K / 64, 8, 16, 4]        run h, vector j, lane l, byte i: u[n, 64h + 4j + i] | u[n, 64h + 32 + 4j + i]
  << 4
           params f32 [K / 32, 2, 16]   per group of 32 along a row its (scale, low): w = low + scale * u
  int8     s8 [K / 4, 16, 4]            q[n, k] at [k // 4, l, k % 4]
           params f32 [K / 32, 16]      per group of 32 its scale: w = scale * q
Rows past N (the last panel's padding) are zero with zero parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 16
GROUP = 32
KINDS = {
    np.dtype(np.float32): "float32",
    np.dtype(jnp.bfloat16): "bfloat16",
    np.dtype(np.uint8): "int4",
    np.dtype(np.int8): "int8",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """panels [..., P, per panel] and params [..., P, per panel] float32 (integer kinds; else a [1] zero) of a
    [..., n, k] matrix ([out, in]); the kind follows the panels' dtype (KINDS)."""

    panels: Any
    params: Any
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))

    @property
    def kind(self) -> str:
        return KINDS[np.dtype(self.panels.dtype)]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.panels.shape[:-2]) + (self.n, self.k)

    @property
    def dtype(self):
        return self.panels.dtype

    def rows(self, ids):
        """Rows `ids` of the matrix as float32 [..ids, K] (of a matrix without a layer axis)."""
        p, lane, k = ids // PANEL, ids % PANEL, self.k
        panels = self.panels
        if self.kind == "float32":
            return panels.reshape(-1, k, PANEL)[p, :, lane]
        if self.kind == "bfloat16":
            return panels.reshape(-1, k // 2, PANEL, 2)[p, :, lane].reshape(*ids.shape, k).astype(jnp.float32)
        if self.kind == "int8":
            q = panels.reshape(-1, k // 4, PANEL, 4)[p, :, lane].reshape(*ids.shape, k // GROUP, GROUP)
            scale = self.params.reshape(-1, k // GROUP, PANEL)[p, :, lane]
            return (q.astype(jnp.float32) * scale[..., None]).reshape(*ids.shape, k)
        b = panels.reshape(-1, k // 64, 8, PANEL, 4)[p, :, :, lane]  # [.., K/64, 8, 4]
        u = jnp.stack([b & 0x0F, b >> 4], axis=-3).astype(jnp.float32)  # [.., K/64, 2 halves, 8, 4]
        u = u.reshape(*ids.shape, k // GROUP, GROUP)
        pairs = self.params.reshape(-1, k // GROUP, 2, PANEL)[p, :, :, lane]  # [.., G, 2]
        return (pairs[..., 1:2] + pairs[..., 0:1] * u).reshape(*ids.shape, k)


def _panels(w: np.ndarray) -> tuple[np.ndarray, int]:
    """[..., N, K] -> [..., P, 16, K] with the rows past N zero; and N."""
    *lead, n, k = w.shape
    p = -(-n // PANEL)
    out = np.zeros((*lead, p * PANEL, k), w.dtype)
    out[..., :n, :] = w
    return out.reshape(*lead, p, PANEL, k), n


def _device(panels: np.ndarray, params: np.ndarray | None, n: int, k: int) -> PackedMatrix:
    params = np.zeros((1,), np.float32) if params is None else params.astype(np.float32)
    return PackedMatrix(jnp.asarray(panels), jnp.asarray(params), n, k)


def pack_float(w) -> PackedMatrix:
    """A float32 or bfloat16 matrix [..., N, K] ([out, in]); bfloat16 needs an even K."""
    w = np.asarray(w)
    k = w.shape[-1]
    t, n = _panels(w)
    lead = t.shape[:-3]
    if w.dtype == np.float32:
        return _device(np.ascontiguousarray(np.swapaxes(t, -1, -2)).reshape(*lead, t.shape[-3], k * PANEL), None, n, k)
    if w.dtype != jnp.bfloat16 or k % 2:
        raise ValueError(f"pack_float: float32, or bfloat16 with an even K, got {w.dtype} K={k}")
    pairs = t.reshape(*t.shape[:-1], k // 2, 2)  # [..., P, 16, K/2, 2]
    out = np.ascontiguousarray(np.swapaxes(pairs, -3, -2))  # [..., P, K/2, 16, 2]
    return _device(out.reshape(*lead, t.shape[-3], k * PANEL), None, n, k)


def pack_int4(q, pairs) -> PackedMatrix:
    """model/quant.Int4Matrix's parts: q u8 [..., N, K / 2] (runs of 64: byte j holds weight j low, j + 32 high)
    and pairs f32 [..., N, K / 32, 2] (scale, low)."""
    q, pairs = np.asarray(q), np.asarray(pairs, np.float32)
    *lead, n, half = q.shape
    k = 2 * half
    runs = q.reshape(*lead, n, k // 64, 32)
    u = np.concatenate([runs & 0x0F, runs >> 4], axis=-1).reshape(*lead, n, k)  # each weight's step, in order
    t, _ = _panels(u)  # [..., P, 16, K]
    t = t.reshape(*t.shape[:-1], k // 64, 2, 8, 4)  # [..., P, l, h, half, j, i]
    t = np.moveaxis(t, -5, -2)  # [..., P, h, half, j, l, i]
    packed = (t[..., 0, :, :, :] | (t[..., 1, :, :, :] << 4)).astype(np.uint8)  # [..., P, h, j, l, i]
    params, _ = _panels(pairs.reshape(*lead, n, k // GROUP * 2))  # [..., P, 16, G * 2]
    params = np.moveaxis(params.reshape(*params.shape[:-1], k // GROUP, 2), -3, -1)  # [..., P, G, 2, 16]
    p = packed.shape[-5]
    return _device(packed.reshape(*lead, p, 8 * k), params.reshape(*lead, p, k // GROUP * 2 * PANEL), n, k)


def pack_int8(q, scale) -> PackedMatrix:
    """model/quant.Int8Matrix's parts: q s8 [..., N, K] and scale f32 [..., N] (per row) or [..., N, K / 32]."""
    q, scale = np.asarray(q), np.asarray(scale, np.float32)
    *lead, n, k = q.shape
    if k % GROUP:
        raise ValueError(f"pack_int8: K must be a multiple of {GROUP}, got {k}")
    if scale.ndim == q.ndim - 1:  # one per row: the same scale for each of its groups
        scale = np.repeat(scale[..., None], k // GROUP, axis=-1)
    t, _ = _panels(q)  # [..., P, 16, K]
    t = np.swapaxes(t.reshape(*t.shape[:-1], k // 4, 4), -3, -2)  # [..., P, K/4, 16, 4]
    params, _ = _panels(scale)  # [..., P, 16, G]
    params = np.swapaxes(params, -1, -2)  # [..., P, G, 16]
    p = t.shape[-4]
    return _device(
        np.ascontiguousarray(t).reshape(*lead, p, 16 * k), params.reshape(*lead, p, k // GROUP * PANEL), n, k
    )
