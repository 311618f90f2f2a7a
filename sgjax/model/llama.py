"""The decoder forward of every family (model/families.py: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the mixtures
of experts Qwen3-MoE, Mixtral, OLMoE through model/moe.py) as pure functions over the Weights pytree; the blocks a
family changes are ModelConfig switches.

One call processes a ragged batch over the paged KV pool. Its one layer loop scans stacked layers (compile time flat
in depth) or unrolls a tuple of per-layer weights (accelerators). Who multiplies by the matrices is the step plan's
`Ops` (XLA's dots here; the CPU's native kernel in model/native.py), the only thing the forward is told.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model import lora as lora_mod
from sgjax.model.batch import StepBatch
from sgjax.model.config import ModelConfig, RopeScaling
from sgjax.model.moe import moe_mlp
from sgjax.model.quant import Fp8Matrix, Int8Matrix, is_quantized, w8a8_dot
from sgjax.model.weights import DENSE_LEAVES, Weights


def rms_norm(x, weight, eps: float, row_sum=None):
    """HF's RMSNorm in float32. row_sum: how a row's squares are summed (Ops.row_sum; None: XLA's reduction)."""
    x32 = x.astype(jnp.float32)
    squares = x32 * x32
    total = jnp.sum(squares, axis=-1) if row_sum is None else row_sum(squares)
    y = x32 * jax.lax.rsqrt(total[..., None] / x.shape[-1] + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def tree_sum(x):
    """Sum over the last axis in one fixed order whatever the other axes: halves added elementwise (the row padded
    with zeros to a power of two). XLA's CPU reduction vectorizes a [T, D] row sum differently for different T (a
    row of a 1-row step and of an 8-row step differed in the last bit), which would make a request's tokens depend
    on its batch; elementwise adds have no order to choose."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_tables(positions, inv_freq):
    """(cos, sin), each f32[..., T, D/2], of positions [T] at frequencies inv_freq [..., D/2]: made once a step for
    each distinct set of frequencies, not in every layer (XLA's CPU fused them into each use, a sine and a cosine per
    query and key element, ~8% of a decode step)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[..., None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x, rope):
    """HF's rotate-half RoPE. x: [T, H, D]; rope: rope_tables' (cos, sin) for x's positions."""
    cos, sin = rope[0][:, None, :], rope[1][:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dot(h, w, nk: bool = False, out_dtype=None, fp8_activations: bool = False):
    """h @ w (w [in, out]; nk: w [out, in], the tied head's embedding) in h's dtype or out_dtype. A matrix of
    another dtype (bf16 under float32 activations) takes h in its dtype, with float32 accumulation; one row of such
    a product is computed as two (XLA's CPU runs a one-row bf16 product several times slower than a two-row one).
    fp8_activations: an fp8 matrix's product quantizes h per token as well (w8a8; else w8a16)."""
    out_dtype = out_dtype or h.dtype
    if isinstance(w, Fp8Matrix) and fp8_activations:
        if w.grouped:  # loading refuses w8a8 over a block-scaled checkpoint first (engine/loading.py)
            raise ValueError("w8a8 products take fp8 matrices with a scale per row, not per block")
        return w8a8_dot(h, w, out_dtype)
    if isinstance(w, (Fp8Matrix, Int8Matrix)) and not w.grouped:
        # bf16 holds every int8 and every e4m3 value exactly; the scale is per output row
        out = dot(h.astype(jnp.bfloat16), w.q.astype(jnp.bfloat16), True, jnp.float32)
        return (out * w.scale).astype(out_dtype)
    if isinstance(w, Fp8Matrix):  # block scales
        return grouped_fp8_dot(h, w, out_dtype)
    if is_quantized(w):  # [out, in] always; scales per group along a row
        return dot(h.astype(jnp.bfloat16), w.widened(jnp.bfloat16), True, out_dtype)
    if w.dtype == h.dtype and not nk:
        return (h @ w).astype(out_dtype)
    rows, x = h.shape[0], h.astype(w.dtype)
    if rows == 1 and w.dtype != h.dtype:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    out = jax.lax.dot_general(x, w, (((1,), (1 if nk else 0,)), ((), ())), preferred_element_type=jnp.float32)
    return out[:rows].astype(out_dtype)


def grouped_fp8_dot(h, w: Fp8Matrix, out_dtype):
    """h [T, K] @ w.T for a block-scaled fp8 matrix (scales f32[N, G] per K / G columns), in h's dtype (a float32
    model's products exact). Few rows: one product per column group ([G, T, N] float32 partial sums, then scaled and
    summed), reading the e4m3 bytes once; widening the matrix first would write and read it again in h's dtype,
    more bytes than the partial sums while T < K / (2 G) (64 rows at 128-wide groups). More rows: widened first."""
    t, k = h.shape
    n, g = w.scale.shape
    if 2 * g * t > k:
        return dot(h, w.widened(h.dtype), True, out_dtype)
    hg = h.reshape(t, g, k // g)
    qg = w.q.reshape(n, g, k // g).astype(h.dtype)
    parts = jax.lax.dot_general(hg, qg, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.float32)  # [G, T, N]
    return jnp.einsum("gtn,ng->tn", parts, w.scale).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Indexed:
    """A stacked matrix [L, ...] and the (traced) layer a scan body is at: read in place by Ops that can
    (the native kernel), where the scan slicing it would copy the layer's matrix every step."""

    stacked: Any
    index: Any


def xla_dots(h, matrices, out_dtype=None, tied: bool = False, fp8_activations: bool = False):
    """h @ each matrix with XLA's dots (`dot`); tied: the matrices are [out, in] (the embedding as the head)."""
    return [
        dot(h, m.stacked[m.index] if isinstance(m, Indexed) else m, tied, out_dtype, fp8_activations) for m in matrices
    ]


@dataclasses.dataclass(frozen=True)
class Ops:
    """The step plan's arithmetic for the forward. dots(h, matrices, out_dtype, tied) -> one product per matrix
    (they share h); in_place: a scanned forward passes its stacked dense matrices whole, as `Indexed`, instead of
    slicing them; row_sum: how a norm sums a row (None: XLA's reduction; tree_sum where rows must not depend on
    their batch)."""

    dots: Callable = xla_dots
    in_place: bool = False
    row_sum: Callable | None = None

    def norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps, self.row_sum)


XLA = Ops()
XLA_W8A8 = Ops(functools.partial(xla_dots, fp8_activations=True))  # fp8 matrices' products quantize h too


def _block(
    x, pool, w, layer, batch: StepBatch, cfg: ModelConfig, attention, experts_fn=None, ops: Ops = XLA, lora=None
):
    """One transformer block on the ragged rows; writes its K/V into the pool at `layer` = (index, window, rope):
    the layer's index, sliding window (0: none) and RoPE tables (rope_tables; Gemma 3's local and global layers
    differ).
    lora: this layer's adapter matrices and the rows' slot mask (model/lora.py add), or None.
    Returns ((x, pool), expert token counts i32[E] of the real rows, or None for a dense MLP)."""
    index, window, rope = layer
    num_rows = x.shape[0]
    with jax.named_scope("qkv"):
        h = ops.norm(x, w.attn_norm, cfg.rms_norm_eps)
        q, k, v = lora_mod.add(lora, h, ("wq", "wk", "wv"), ops.dots(h, (w.wq, w.wk, w.wv)))
        if w.bq is not None:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        if cfg.qk_norm and not cfg.qk_norm_per_head:  # OLMoE: over the whole projections
            q, k = ops.norm(q, w.q_norm, cfg.rms_norm_eps), ops.norm(k, w.k_norm, cfg.rms_norm_eps)
        if cfg.qkv_clip is not None:
            q, k, v = (jnp.clip(a, -cfg.qkv_clip, cfg.qkv_clip) for a in (q, k, v))
        q = q.reshape(num_rows, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and cfg.qk_norm_per_head:
            q, k = ops.norm(q, w.q_norm, cfg.rms_norm_eps), ops.norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = v.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
    with jax.named_scope("attention"):
        # Only the families that have them pass a window or a soft cap: Llama's call stays the plain signature.
        extra = {"window": window} if cfg.sliding_window else {}
        if cfg.attn_softcap:
            extra["softcap"] = cfg.attn_softcap
        attn, pool = attention(q, k, v, pool, index, batch.attn, sm_scale=cfg.sm_scale, **extra)
        attn = attn.reshape(num_rows, cfg.q_size).astype(x.dtype)
        (out,) = lora_mod.add(lora, attn, ("wo",), ops.dots(attn, (w.wo,)))
        if cfg.sandwich_norms:
            out = ops.norm(out, w.post_attn_norm, cfg.rms_norm_eps)
        x = x + out
    with jax.named_scope("mlp"):
        h = ops.norm(x, w.mlp_norm, cfg.rms_norm_eps)
        counts = None
        if cfg.is_moe:
            valid = jnp.arange(num_rows) < batch.attn.cu_q_lens[-1]  # padded rows route too, but are not counted
            out, counts = moe_mlp(h, w, cfg, valid, experts_fn)
        else:
            act = jax.nn.silu if cfg.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
            gate, up = lora_mod.add(lora, h, ("w_gate", "w_up"), ops.dots(h, (w.w_gate, w.w_up)))
            inner = act(gate) * up
            (out,) = lora_mod.add(lora, inner, ("w_down",), ops.dots(inner, (w.w_down,)))
        if cfg.sandwich_norms:
            out = ops.norm(out, w.post_mlp_norm, cfg.rms_norm_eps)
        return (x + out, pool), counts


def layer_rope(cfg: ModelConfig) -> np.ndarray:
    """[L, head_dim / 2] RoPE frequencies per layer: the global base and scaling, or Gemma 3's local base on its
    sliding layers."""
    glob = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None:
        return np.broadcast_to(glob, (cfg.num_layers, glob.shape[0]))
    local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, RopeScaling())
    return np.stack([local if cfg.window(i) else glob for i in range(cfg.num_layers)])


def forward(
    weights: Weights,
    pool,
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    attention,
    ops: Ops = XLA,
    input_embeds=None,
    output: str = "logits",
    experts_fn=None,
    with_stats: bool = False,
    first_layers: int | None = None,
    lora=None,
):
    """Returns (logits f32[B, V] for the rows in batch.logits_idx, the updated pool); output="hidden": the final
    normed hidden states f32[B, D] of those rows instead (embeddings). with_stats=True adds a third element: a
    mixture of experts' tokens per expert per layer, i32[L, E] (None for a dense model).

    ops: the step plan's arithmetic (who multiplies, how norms sum). experts_fn replaces model/moe.experts (the experts
    under expert or tensor parallelism, engine/mesh.py). input_embeds ([T, D], optional) replaces the token-embedding
    lookup, e.g. a prompt with image features merged in at its placeholder rows (vision.merge_image_features).

    Stacked layers (a LayerWeights with a leading layer axis) are scanned: compile time does not grow with depth. A
    tuple of per-layer LayerWeights is unrolled: on the GPU, scanning slices (copies) each layer's weights before its
    matmuls, which tripled weight traffic at decode (docs/journal/architecture-measured.md).

    first_layers: run only the first N layers, then the final norm and the head (self-speculation's draft,
    engine/drafter.py); the other layers' pool entries are left as they are.

    lora: (model/lora.LoraStacks, each token row's slot i32[T], -1 for none): the rows' adapters (model/lora.py).
    """
    with matmul_precision(cfg.dtype):
        out, pool, stats = _forward(
            weights, pool, batch, cfg, attention, ops, input_embeds, output, experts_fn, first_layers, lora
        )
    return (out, pool, stats) if with_stats else (out, pool)


def matmul_precision(dtype: str):
    """float32 means float32 dots. XLA's GPU default runs them as TF32 (~1e-3 relative error): on the H200 the
    fp32 SmolLM2's greedy outputs differed from HF's, and between schedules of the same prompts. bf16 keeps the
    default (bf16 inputs, fp32 accumulation). Traced inside the jit, so it is part of the step's program."""
    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()


def embed_rows(embed, batch: StepBatch, cfg: ModelConfig, input_embeds=None):
    """The residual stream's first value: the tokens' rows of `embed` (scaled where the family does), or
    input_embeds."""
    if input_embeds is not None:
        return input_embeds.astype(jnp.dtype(cfg.dtype))
    x = embed_lookup(embed, batch.input_ids).astype(jnp.dtype(cfg.dtype))
    if cfg.embed_scale:  # in the model's dtype, as HF's Gemma rounds it
        x = x * jnp.asarray(cfg.hidden_size**0.5, jnp.dtype(cfg.dtype))
    return x


def embed_lookup(embed, ids):
    """Rows `ids` of the embedding (a quantized or packed one read back as float32)."""
    return embed.rows(ids) if hasattr(embed, "rows") else embed[ids]


def head(weights, x, batch: StepBatch, cfg: ModelConfig, ops: Ops = XLA, output: str = "logits"):
    """The final norm on the batch.logits_idx rows, then their logits f32[B, V] (or, output="hidden", the normed
    hidden states f32[B, D])."""
    with jax.named_scope("lm_head"):
        x = ops.norm(x[batch.logits_idx], weights.final_norm, cfg.rms_norm_eps)
        if output == "hidden":
            return x.astype(jnp.float32)
        if weights.lm_head is None:  # tied: contract with the embedding rows, no transposed copy
            (logits,) = ops.dots(x, (weights.embed,), jnp.float32, tied=True)
        else:
            (logits,) = ops.dots(x, (weights.lm_head,), jnp.float32)
        if cfg.final_softcap:
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def _forward(
    weights,
    pool,
    batch,
    cfg,
    attention,
    ops,
    input_embeds,
    output="logits",
    experts_fn=None,
    first_layers=None,
    lora=None,
):
    freqs, kind = np.unique(layer_rope(cfg), axis=0, return_inverse=True)  # one set (Llama) or two (Gemma 3)
    depth = first_layers or cfg.num_layers
    kind = kind.reshape(-1)[:depth]
    tables = rope_tables(batch.positions, jnp.asarray(freqs))  # [K, T, D/2] each
    x = embed_rows(weights.embed, batch, cfg, input_embeds)
    block = functools.partial(_block, batch=batch, cfg=cfg, attention=attention, experts_fn=experts_fn, ops=ops)
    stacks, mask = (None, None) if lora is None else (lora[0], lora_mod.row_mask(lora[1], lora[0], jnp.float32))
    windows = [cfg.window(i) for i in range(depth)]
    if isinstance(weights.layers, (tuple, list)):
        # One jitted block per distinct window, called once per layer: jax traces and lowers it once (the module
        # calls one function L times; XLA inlines it), not L times: unrolled layer by layer, tracing and lowering a
        # step shape (its Pallas kernels built again for every layer) took several times its XLA compilation
        # (docs/journal/engine-h200.md).
        jitted = {
            win: jax.jit(
                lambda x, pool, w, i, rope, ab, win=win: block(
                    x, pool, w, (i, win, rope), lora=None if ab is None else (ab, mask)
                )
            )
            for win in set(windows)
        }
        stats = []
        for i, w in enumerate(weights.layers[:depth]):
            with jax.named_scope(f"layer{i}"):
                rope = (tables[0][kind[i]], tables[1][kind[i]])
                ab = None if stacks is None else lora_mod.layer(stacks, i)
                (x, pool), counts = jitted[windows[i]](x, pool, w, jnp.int32(i), rope, ab)
                stats.append(counts)
        return head(weights, x, batch, cfg, ops, output), pool, (jnp.stack(stats) if cfg.is_moe else None)
    layers = weights.layers
    whole = [n for n in DENSE_LEAVES if ops.in_place and getattr(layers, n, None) is not None]
    scanned_layers = dataclasses.replace(layers, **dict.fromkeys(whole))
    if depth < cfg.num_layers:  # the matrices read in place stay whole (indexed); the rest are sliced
        scanned_layers = jax.tree.map(lambda a: a[:depth], scanned_layers)
    same = len(set(windows)) == 1  # every layer alike (Llama, Mistral): the window stays a static int

    def body(carry, inputs):
        w, i, win, k, ab = inputs
        w = dataclasses.replace(w, **{n: Indexed(getattr(layers, n), i) for n in whole})
        rope = (tables[0][0], tables[1][0]) if len(freqs) == 1 else (tables[0][k], tables[1][k])
        return block(*carry, w, (i, windows[0] if same else win, rope), lora=None if ab is None else (ab, mask))

    scanned = (
        scanned_layers,
        jnp.arange(depth, dtype=jnp.int32),
        jnp.asarray(windows, jnp.int32),
        jnp.asarray(kind, jnp.int32),
        None if stacks is None else jax.tree.map(lambda a: a[:depth], (stacks.a, stacks.b)),
    )
    (x, pool), stats = jax.lax.scan(body, (x, pool), scanned)
    return head(weights, x, batch, cfg, ops, output), pool, stats
