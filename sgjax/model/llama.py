"""Llama-family forward (Llama, Qwen2) as pure functions over the Weights pytree.

One call processes a ragged batch over the paged KV pool and scans over the stacked layers, so
compile time does not grow with depth.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model.batch import StepBatch
from sgjax.model.config import ModelConfig, RopeScaling
from sgjax.model.weights import Weights


def rms_norm(x, weight, eps: float):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


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


def apply_rope(x, positions, inv_freq):
    """HF's rotate-half RoPE. x: [T, H, D]; positions: [T]."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _block(x, pool, w, index, batch: StepBatch, cfg: ModelConfig, attention, inv_freq):
    """One transformer block on the ragged rows; writes its K/V into layer `index` of the pool."""
    num_rows = x.shape[0]
    with jax.named_scope("qkv"):
        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        q, k, v = h @ w.wq, h @ w.wk, h @ w.wv
        if w.bq is not None:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        q = apply_rope(q.reshape(num_rows, cfg.num_heads, cfg.head_dim), batch.positions, inv_freq)
        k = apply_rope(k.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim), batch.positions, inv_freq)
        v = v.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
    with jax.named_scope("attention"):
        attn, pool = attention(q, k, v, pool, index, batch.attn, sm_scale=cfg.head_dim ** -0.5)
        x = x + attn.reshape(num_rows, cfg.q_size).astype(x.dtype) @ w.wo
    with jax.named_scope("mlp"):
        h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
        return x + (jax.nn.silu(h @ w.w_gate) * (h @ w.w_up)) @ w.w_down, pool


def forward(weights: Weights, pool, batch: StepBatch, *, cfg: ModelConfig, attention, input_embeds=None,
            output: str = "logits"):
    """Returns (logits f32[B, V] for the rows in batch.logits_idx, the updated pool); output="hidden": the final
    normed hidden states f32[B, D] of those rows instead (embeddings).

    input_embeds ([T, D], optional) replaces the token-embedding lookup, e.g. a prompt with image features merged
    in at its placeholder rows (vision.merge_image_features).

    Stacked layers (a LayerWeights with a leading layer axis) are scanned: compile time does not grow
    with depth. A tuple of per-layer LayerWeights is unrolled: on the GPU, scanning slices (copies) each
    layer's weights before its matmuls, which tripled weight traffic at decode (docs/architecture.md).
    """
    with matmul_precision(cfg.dtype):
        return _forward(weights, pool, batch, cfg, attention, input_embeds, output)


def matmul_precision(dtype: str):
    """float32 means float32 dots. XLA's GPU default runs them as TF32 (~1e-3 relative error): on the H200 the
    fp32 SmolLM2's greedy outputs differed from HF's, and between schedules of the same prompts. bf16 keeps the
    default (bf16 inputs, fp32 accumulation). Traced inside the jit, so it is part of the step's program."""
    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()


def _forward(weights, pool, batch, cfg, attention, input_embeds, output="logits"):
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    x = (weights.embed[batch.input_ids] if input_embeds is None else input_embeds).astype(jnp.dtype(cfg.dtype))
    block = functools.partial(_block, batch=batch, cfg=cfg, attention=attention, inv_freq=inv_freq)
    if isinstance(weights.layers, (tuple, list)):
        for i, w in enumerate(weights.layers):
            with jax.named_scope(f"layer{i}"):
                x, pool = block(x, pool, w, jnp.int32(i))
    else:
        def body(carry, inputs):
            return block(*carry, *inputs), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, pool), _ = jax.lax.scan(body, (x, pool), (weights.layers, layer_ids))
    with jax.named_scope("lm_head"):
        x = rms_norm(x[batch.logits_idx], weights.final_norm, cfg.rms_norm_eps)
        if output == "hidden":
            return x.astype(jnp.float32), pool
        if weights.lm_head is None:  # tied: contract with the embedding rows, no transposed copy
            logits = jnp.einsum("bd,vd->bv", x, weights.embed, preferred_element_type=jnp.float32)
        else:
            logits = jnp.dot(x, weights.lm_head, preferred_element_type=jnp.float32)
    return logits, pool
