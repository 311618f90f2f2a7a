"""Weight-only int8 matrices (--weight-dtype int8): each output row of a matrix as int8 with a float32 scale, the
row's largest magnitude / 127. Activations, accumulation and everything outside the matrices stay in the model's
dtype. On a CPU the few-row products of decode read the int8 rows directly (kernels/cpu_matmul.cc: a quarter of
float32's bytes); elsewhere a product widens the matrix to bf16 (every int8 is exact there) and scales its output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """q int8[..., N, K] ([out, in], config.matrix_layout "nk") and scale f32[..., N]; stacked layers lead both."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype

    def rows(self, ids):
        """Rows `ids` of the matrix as float32 (an embedding lookup)."""
        return self.q[ids].astype(jnp.float32) * self.scale[ids][..., None]

    def layer(self, index) -> "Int8Matrix":
        return Int8Matrix(self.q[index], self.scale[index])


def quantize(w) -> Int8Matrix:
    """Symmetric per-row int8 of w [..., N, K] (rows of zeros get scale 1, not 0/0). numpy in, numpy out."""
    host = isinstance(w, np.ndarray)
    xp = np if host else jnp
    w32 = w.astype(xp.float32)
    peak = xp.max(xp.abs(w32), axis=-1)
    scale = xp.where(peak > 0, peak / 127.0, 1.0).astype(xp.float32)
    q = xp.clip(xp.round(w32 / scale[..., None]), -127, 127).astype(xp.int8)
    return Int8Matrix(q, scale)


def dequantized(w: Int8Matrix, dtype=jnp.float32):
    return (w.q.astype(jnp.float32) * w.scale[..., None]).astype(dtype)
