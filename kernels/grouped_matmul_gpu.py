"""Grouped matmuls for mixtures of experts on CUDA GPUs, in Pallas-Triton (installed as
sgjax.kernels.grouped_matmul_gpu).

`grouped_matmul(x, w, sizes)` computes what `jax.lax.ragged_dot(x, w, sizes)` does: x [M, K] holds rows sorted by
group, group g (an expert) is the next sizes[g] rows and multiplies w[g] [K, N]; rows after the last group are left
unwritten (model/moe.py drops them). XLA's ragged_dot on the GPU reads every expert's weights whatever the routing
(docs/journal/architecture-models.md); here each program owns one tile of `block_m` rows of one group and
`block_n` output columns, so only routed experts' weights are read, and a tile never spans two groups.

The tile table (which group and rows each program owns) is a few XLA ops over `sizes`; its length is static,
cdiv(M, block_m) + min(E, M), an upper bound on the tiles any routing needs, and the programs past the real tiles
find no rows and load nothing. `gate_up` fuses the first two expert matmuls: act(x @ w_gate) * (x @ w_up), one read
of x and one store of the [M, F] product.

Loads and stores use integer-array indices with masks (the form both the Triton lowering and interpret mode take,
as in pallas_gpu). Block shapes are powers of two and must divide K and N (`supported`); model/moe.py uses
ragged_dot where they do not.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # jax 0.11 deprecates the Triton backend
    from jax.experimental.pallas import triton as plgpu

GROUP, ROW_START, ROW_END = 0, 1, 2


def tile_table(sizes, num_rows: int, block_m: int):
    """i32[num_tiles, 3] of (group, first row, end row): group g's rows cut into tiles of block_m, in group order;
    unused tiles have no rows (start = end = 0). num_tiles = cdiv(num_rows, block_m) + min(E, num_rows)."""
    num_groups = sizes.shape[0]
    num_tiles = -(-num_rows // block_m) + min(num_groups, num_rows)
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    per_group = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(per_group)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32), num_groups - 1)
    start = ends[g] - sizes[g] + (t - (tile_ends[g] - per_group[g])) * block_m
    end = jnp.minimum(start + block_m, ends[g])
    real = t < tile_ends[-1]
    return jnp.stack([g, jnp.where(real, start, 0), jnp.where(real, end, 0)], axis=1)


def fit(config: dict, k_dim: int, n_dim: int) -> dict:
    """config with block_k and block_n no larger than K and N (a small model's experts)."""
    return dict(
        config, block_k=min(config["block_k"], _pow2_floor(k_dim)), block_n=min(config["block_n"], _pow2_floor(n_dim))
    )


def supported(k_dim: int, n_dim: int, config: dict) -> bool:
    config = fit(config, k_dim, n_dim)
    return k_dim % config["block_k"] == 0 and n_dim % config["block_n"] == 0


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def default_config(num_rows: int, num_groups: int, dtype) -> dict:
    """Static block sizes from the shapes: a tile about as tall as a group's average share of the rows (16, the
    smallest tensor-core dot, for decode steps, where most routed experts get one or two rows)."""
    per_group = num_rows / max(num_groups, 1)
    block_m = 16 if per_group <= 16 else 32 if per_group <= 32 else 64 if per_group <= 64 else 128
    small = jnp.dtype(dtype).itemsize <= 2
    return dict(
        block_m=block_m,
        block_n=128 if small else 64,
        block_k=64 if small else 32,
        num_warps=4 if block_m <= 64 else 8,
        num_stages=3,
    )


def _act(x, activation: str):
    if activation == "silu":
        return x / (1.0 + jnp.exp(-x))
    if activation == "gelu_tanh":
        return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    raise ValueError(f"unknown activation {activation!r}")


def _kernel(tiles_ref, x_ref, *refs, block_m, block_n, block_k, k_dim, activation):
    *w_refs, o_ref = refs
    t, j = pl.program_id(0), pl.program_id(1)
    g, row_start, row_end = tiles_ref[t, GROUP], tiles_ref[t, ROW_START], tiles_ref[t, ROW_END]
    rows = row_start + jnp.arange(block_m, dtype=jnp.int32)
    row_ok = rows < row_end
    cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    kk = jnp.arange(block_k, dtype=jnp.int32)
    # Pallas-Triton runs fp32 dots at DEFAULT precision as TF32; fp32 inputs ask for the exact mode
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def step(i, accs):
        kidx = i * block_k + kk
        x = plgpu.load(x_ref.at[rows[:, None], kidx[None, :]], mask=row_ok[:, None], other=0)
        w_rows = g * k_dim + kidx  # w viewed as [E * K, N]
        return tuple(
            acc
            + jax.lax.dot(
                x, w_ref[w_rows[:, None], cols[None, :]], precision=precision, preferred_element_type=jnp.float32
            )
            for w_ref, acc in zip(w_refs, accs)
        )

    # an unused tile loads nothing (a product, not jnp.where of two Python ints: Pallas-Triton lowers that select
    # as i1)
    n_k = (row_end > row_start).astype(jnp.int32) * (k_dim // block_k)
    zero = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, n_k, step, tuple(zero for _ in w_refs))
    out = accs[0] if activation is None else _act(accs[0], activation) * accs[1]
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=row_ok[:, None])


def _call(x, weights, sizes, *, activation, out_dtype, interpret, config, tiles):
    num_rows, k_dim = x.shape
    num_groups, _, n_dim = weights[0].shape
    cfg = default_config(num_rows, num_groups, x.dtype)
    cfg = fit(dict(cfg, **(config or {})), k_dim, n_dim)
    if not supported(k_dim, n_dim, cfg):
        raise ValueError(f"block_k {cfg['block_k']} / block_n {cfg['block_n']} must divide K {k_dim} / N {n_dim}")
    if tiles is None:
        tiles = tile_table(sizes, num_rows, cfg["block_m"])
    elif tiles.shape[0] != -(-num_rows // cfg["block_m"]) + min(num_groups, num_rows):
        raise ValueError(f"tiles were cut for another block_m than {cfg['block_m']}")
    kernel = functools.partial(
        _kernel,
        block_m=cfg["block_m"],
        block_n=cfg["block_n"],
        block_k=cfg["block_k"],
        k_dim=k_dim,
        activation=activation,
    )
    return pl.pallas_call(
        kernel,
        grid=(tiles.shape[0], n_dim // cfg["block_n"]),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), out_dtype or x.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name="grouped_matmul" if activation is None else "grouped_gate_up",
    )(tiles, x, *(w.reshape(num_groups * k_dim, n_dim) for w in weights))


def grouped_matmul(x, w, sizes, *, out_dtype=None, interpret: bool = False, config: dict | None = None, tiles=None):
    """ragged_dot(x [M, K], w [E, K, N], sizes i32[E]) -> [M, N] in out_dtype (x's by default), f32-accumulated;
    rows past sum(sizes) are unwritten. `tiles`: tile_table(sizes, M, block_m) when the caller has it already
    (an MoE layer's two kernels share it)."""
    return _call(x, [w], sizes, activation=None, out_dtype=out_dtype, interpret=interpret, config=config, tiles=tiles)


def gate_up(
    x, w_gate, w_up, sizes, *, activation: str = "silu", interpret: bool = False, config: dict | None = None, tiles=None
):
    """act(x @ w_gate[g]) * (x @ w_up[g]) per group, [M, F] in x's dtype; rows past sum(sizes) are unwritten."""
    return _call(
        x, [w_gate, w_up], sizes, activation=activation, out_dtype=None, interpret=interpret, config=config, tiles=tiles
    )
