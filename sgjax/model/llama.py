"""The decoder forward of every family (model/families.py: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the mixtures
of experts Qwen3-MoE, Mixtral, OLMoE through model/moe.py) as pure functions over the Weights pytree; the blocks a
family changes are ModelConfig switches.

One call processes a ragged batch over the paged KV pool and scans over the stacked layers, so
compile time does not grow with depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model.batch import StepBatch
from sgjax.model.config import ModelConfig, RopeScaling
from sgjax.model.moe import moe_mlp
from sgjax.model.quant import Int8Matrix, is_quantized
from sgjax.model.weights import NK_LEAVES, Weights

# Under config.matmul "cpu", products of at most this many rows go through kernels/cpu_matmul.cc: decode's few
# rows are bound by reading the matrices, which the kernel does near the memory's speed. More rows (prefill) keep
# XLA's dots: past 4 rows they beat the kernel's bf16 vector loop, and int8 / int4 products, widened to bf16 per
# call there, keep 32 rows of the kernel's integer dot products. A step of native rows only scans the per-layer
# matrices in one program (_forward), so its compilation does not grow with depth (docs/engine.md).
NATIVE_ROWS = {"bfloat16": 4, "int8": 32, "int4": 32}
# Where the CPU has AMX the kernel's bf16 tile products beat XLA's dots at every row count (2.2x at 512 rows; int8
# and int4 matrices widened to bf16 tiles past 4 rows): every product of a dense model is native, and every step
# one scanned program.
EVERY_ROW = 1 << 30


def native_rows(cfg: ModelConfig) -> int:
    """The most rows a product runs through the native kernel (0: none)."""
    if cfg.matmul != "cpu" or cfg.matrix_layout != "nk":
        return 0
    if cfg.weight_dtype not in NATIVE_ROWS:
        return 0
    if not cfg.is_moe:
        from sgjax.kernels.cpu import has_amx

        if has_amx():
            return EVERY_ROW
    elif cfg.weight_dtype == "bfloat16":
        return 0  # a mixture's native step would unroll its layers (_forward scans dense ones only)
    return NATIVE_ROWS[cfg.weight_dtype]


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


def dot(h, w, nk: bool = False, out_dtype=None):
    """h @ w (w [in, out]; nk: w [out, in], config.matrix_layout) in h's dtype or out_dtype. A matrix of another
    dtype (config.weight_dtype: bf16 under float32 activations) takes h in its dtype, with float32 accumulation;
    one row of such a product is computed as two (XLA's CPU runs a one-row bf16 product ~8x slower than a two-row
    one, docs/engine.md)."""
    out_dtype = out_dtype or h.dtype
    if isinstance(w, Int8Matrix) and not w.grouped:  # bf16 holds every int8 exactly; the scale is per output row
        out = dot(h.astype(jnp.bfloat16), w.q.astype(jnp.bfloat16), nk, jnp.float32)
        return (out * (w.scale if nk else w.scale[..., None, :])).astype(out_dtype)
    if is_quantized(w):  # [out, in] always; scales per group along a row
        return dot(h.astype(jnp.bfloat16), w.widened(jnp.bfloat16), True, out_dtype)
    if w.dtype == h.dtype and not nk:
        return (h @ w).astype(out_dtype)
    rows, x = h.shape[0], h.astype(w.dtype)
    if rows == 1 and w.dtype != h.dtype:
        x = jnp.concatenate([x, jnp.zeros_like(x)])
    out = jax.lax.dot_general(x, w, (((1,), (1 if nk else 0,)), ((), ())), preferred_element_type=jnp.float32)
    return out[:rows].astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class LayerPick:
    """One matrix of every layer and the (traced) index of the layer a scan body is at: the native kernel reads
    that layer's buffer where it is, where scanning stacked weights would need them stacked (a copy)."""

    layers: tuple
    index: Any


def dots(h, matrices, cfg: ModelConfig, out_dtype=None):
    """h @ each of `matrices` (dot's semantics), which share h. Under config.matmul "cpu" a product of at most
    native_rows rows is one call of the native kernel for all of them (LayerPicks, of one index, only there)."""
    nk = cfg.matrix_layout == "nk"
    if h.shape[0] <= native_rows(cfg):
        from sgjax.kernels.cpu import cpu_matmul

        def pair(m):
            return (m.q, m.scale) if is_quantized(m) else (m, None)

        picks = [m for m in matrices if isinstance(m, LayerPick)]
        pairs = [[pair(a) for a in m.layers] if isinstance(m, LayerPick) else pair(m) for m in matrices]
        outs = cpu_matmul(h, picks[0].index if picks else 0, pairs)
        return [out.astype(out_dtype or h.dtype) for out in outs]
    if any(isinstance(m, LayerPick) for m in matrices):
        raise ValueError(f"dots: a LayerPick needs at most {native_rows(cfg)} rows (the native kernel), got "
                         f"{h.shape[0]}")
    return [dot(h, m, nk, out_dtype) for m in matrices]


def _block(x, pool, w, layer, batch: StepBatch, cfg: ModelConfig, attention, experts_fn=None):
    """One transformer block on the ragged rows; writes its K/V into the pool at `layer` = (index, window, rope):
    the layer's index, sliding window (0: none) and RoPE tables (rope_tables; Gemma 3's local and global layers
    differ).
    Returns ((x, pool), expert token counts i32[E] of the real rows, or None for a dense MLP)."""
    index, window, rope = layer
    num_rows = x.shape[0]
    with jax.named_scope("qkv"):
        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        q, k, v = dots(h, (w.wq, w.wk, w.wv), cfg)
        if w.bq is not None:
            q, k, v = q + w.bq, k + w.bk, v + w.bv
        if cfg.qk_norm and not cfg.qk_norm_per_head:  # OLMoE: over the whole projections
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        if cfg.qkv_clip is not None:
            q, k, v = (jnp.clip(a, -cfg.qkv_clip, cfg.qkv_clip) for a in (q, k, v))
        q = q.reshape(num_rows, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and cfg.qk_norm_per_head:
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = v.reshape(num_rows, cfg.num_kv_heads, cfg.head_dim)
    with jax.named_scope("attention"):
        # Only the families that have them pass a window or a soft cap: Llama's call stays the plain signature.
        extra = {"window": window} if cfg.sliding_window else {}
        if cfg.attn_softcap:
            extra["softcap"] = cfg.attn_softcap
        attn, pool = attention(q, k, v, pool, index, batch.attn, sm_scale=cfg.sm_scale, **extra)
        (out,) = dots(attn.reshape(num_rows, cfg.q_size).astype(x.dtype), (w.wo,), cfg)
        if cfg.sandwich_norms:
            out = rms_norm(out, w.post_attn_norm, cfg.rms_norm_eps)
        x = x + out
    with jax.named_scope("mlp"):
        h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
        counts = None
        if cfg.is_moe:
            valid = jnp.arange(num_rows) < batch.attn.cu_q_lens[-1]  # padded rows route too, but are not counted
            out, counts = moe_mlp(h, w, cfg, valid, experts_fn)
        else:
            act = jax.nn.silu if cfg.activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
            gate, up = dots(h, (w.w_gate, w.w_up), cfg)
            (out,) = dots(act(gate) * up, (w.w_down,), cfg)
        if cfg.sandwich_norms:
            out = rms_norm(out, w.post_mlp_norm, cfg.rms_norm_eps)
        return (x + out, pool), counts


def layer_rope(cfg: ModelConfig) -> np.ndarray:
    """[L, head_dim / 2] RoPE frequencies per layer: the global base and scaling, or Gemma 3's local base on its
    sliding layers."""
    glob = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None:
        return np.broadcast_to(glob, (cfg.num_layers, glob.shape[0]))
    local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, RopeScaling())
    return np.stack([local if cfg.window(i) else glob for i in range(cfg.num_layers)])


def forward(weights: Weights, pool, batch: StepBatch, *, cfg: ModelConfig, attention, input_embeds=None,
            output: str = "logits", experts_fn=None, with_stats: bool = False):
    """Returns (logits f32[B, V] for the rows in batch.logits_idx, the updated pool); output="hidden": the final
    normed hidden states f32[B, D] of those rows instead (embeddings). with_stats=True adds a third element: a
    mixture of experts' tokens per expert per layer, i32[L, E] (None for a dense model).

    experts_fn replaces model/moe.experts (the experts under expert or tensor parallelism, engine/mesh.py).

    input_embeds ([T, D], optional) replaces the token-embedding lookup, e.g. a prompt with image features merged
    in at its placeholder rows (vision.merge_image_features).

    Stacked layers (a LayerWeights with a leading layer axis) are scanned: compile time does not grow
    with depth. A tuple of per-layer LayerWeights is unrolled: on the GPU, scanning slices (copies) each
    layer's weights before its matmuls, which tripled weight traffic at decode (docs/architecture.md). It is
    scanned too where every product is the CPU's native kernel, which reads each layer's buffers in place.
    """
    with matmul_precision(cfg.dtype):
        out, pool, stats = _forward(weights, pool, batch, cfg, attention, input_embeds, output, experts_fn)
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
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, jnp.dtype(cfg.dtype))
    return x


def embed_lookup(embed, ids):
    """Rows `ids` of the embedding (a quantized one widened to float32)."""
    return embed.rows(ids) if is_quantized(embed) else embed[ids]


def head(weights, x, batch: StepBatch, cfg: ModelConfig, output: str = "logits"):
    """The final norm on the batch.logits_idx rows, then their logits f32[B, V] (or, output="hidden", the normed
    hidden states f32[B, D])."""
    with jax.named_scope("lm_head"):
        x = rms_norm(x[batch.logits_idx], weights.final_norm, cfg.rms_norm_eps)
        if output == "hidden":
            return x.astype(jnp.float32)
        if weights.lm_head is None:  # tied: contract with the embedding rows, no transposed copy
            (logits,) = dots(x, (weights.embed,), cfg.replace(matrix_layout="nk"), out_dtype=jnp.float32)
        else:
            (logits,) = dots(x, (weights.lm_head,), cfg, out_dtype=jnp.float32)
        if cfg.final_softcap:
            logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits


def _forward(weights, pool, batch, cfg, attention, input_embeds, output="logits", experts_fn=None):
    freqs, kind = np.unique(layer_rope(cfg), axis=0, return_inverse=True)  # one set (Llama) or two (Gemma 3)
    kind = kind.reshape(-1)
    tables = rope_tables(batch.positions, jnp.asarray(freqs))  # [K, T, D/2] each
    x = embed_rows(weights.embed, batch, cfg, input_embeds)
    block = functools.partial(_block, batch=batch, cfg=cfg, attention=attention, experts_fn=experts_fn)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    per_layer = isinstance(weights.layers, (tuple, list))
    if per_layer and not (x.shape[0] <= native_rows(cfg) and not cfg.is_moe):
        # One jitted block per distinct window, called once per layer: jax traces and lowers it once (the module
        # calls one function L times; XLA inlines it), not L times. On the H200 the unrolled SmolLM2 spent 40-75 s
        # tracing and ~60 s lowering each step shape (its Pallas kernels built again for every layer), against 6-7 s
        # of XLA compilation.
        jitted = {win: jax.jit(lambda x, pool, w, i, rope, win=win: block(x, pool, w, (i, win, rope)))
                  for win in set(windows)}
        stats = []
        for i, w in enumerate(weights.layers):
            with jax.named_scope(f"layer{i}"):
                rope = (tables[0][kind[i]], tables[1][kind[i]])
                (x, pool), counts = jitted[windows[i]](x, pool, w, jnp.int32(i), rope)
                stats.append(counts)
        return head(weights, x, batch, cfg, output), pool, (jnp.stack(stats) if cfg.is_moe else None)
    # Scanned: stacked layers, or per-layer ones whose products are all native (the kernel reads each layer's
    # matrices where they are: LayerPick); their norms and biases (a few KB a layer) are stacked each step.
    stacked, pick = weights.layers, None
    if per_layer:
        layers = weights.layers
        names = [f.name for f in dataclasses.fields(layers[0])
                 if f.name in NK_LEAVES and getattr(layers[0], f.name) is not None]
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *[dataclasses.replace(w, **dict.fromkeys(names))
                                                          for w in layers])

        def pick(w, i):
            return dataclasses.replace(w, **{n: LayerPick(tuple(getattr(a, n) for a in layers), i) for n in names})

    same = len(set(windows)) == 1  # every layer alike (Llama, Mistral): the window stays a static int

    def body(carry, inputs):
        w, i, win, k = inputs
        rope = (tables[0][0], tables[1][0]) if len(freqs) == 1 else (tables[0][k], tables[1][k])
        return block(*carry, w if pick is None else pick(w, i), (i, windows[0] if same else win, rope))

    scanned = (stacked, jnp.arange(cfg.num_layers, dtype=jnp.int32), jnp.asarray(windows, jnp.int32),
               jnp.asarray(kind, jnp.int32))
    (x, pool), stats = jax.lax.scan(body, (x, pool), scanned)
    return head(weights, x, batch, cfg, output), pool, stats


class LayerCalls:
    """The layers as host calls: one jitted block per distinct window, called once per layer with that layer's
    weights as whole buffers and the pool donated (model/weights.layer_loop_for "calls"). XLA's CPU runs a bf16
    product fast only on a whole buffer outside a loop, so a scan is slow for bf16 matrices, and an unrolled
    program costs ~1 s of compilation per step shape, where a block compiles like a scan body. The step runs
    ~10-25% slower than the same layers unrolled in one program, whatever the layers per call (docs/engine.md).
    Call it outside jit, between the step's jitted head and tail."""

    def __init__(self, cfg: ModelConfig, attention, experts_fn=None, name: str = "sgjax_layer"):
        self.cfg, self.windows = cfg, [cfg.window(i) for i in range(cfg.num_layers)]

        def run(x, pool, w, index, inv, batch, *, window):
            with matmul_precision(cfg.dtype):
                rope = rope_tables(batch.positions, inv)
                (x, pool), counts = _block(x, pool, w, (index, window, rope), batch, cfg, attention, experts_fn)
            return x, pool, counts

        run.__name__ = run.__qualname__ = name  # its compile events' fun_name
        self.blocks = {win: jax.jit(functools.partial(run, window=win), donate_argnums=1)
                       for win in set(self.windows)}
        self._consts = None

    def consts(self):
        """Each layer's (index, RoPE frequencies) as device arrays, made once (a per-call transfer otherwise)."""
        if self._consts is None:
            rope = layer_rope(self.cfg)
            self._consts = [(jnp.int32(i), jnp.asarray(rope[i])) for i in range(self.cfg.num_layers)]
        return self._consts

    def __call__(self, layers, x, pool, batch):
        """(x, pool, stats i32[L, E] or None) after every layer."""
        stats = []
        for w, win, (index, inv) in zip(layers, self.windows, self.consts()):
            x, pool, counts = self.blocks[win](x, pool, w, index, inv, batch)
            stats.append(counts)
        return x, pool, (jnp.stack(stats) if self.cfg.is_moe else None)

    def lower_all(self, layers, x, pool, batch) -> list:
        """The blocks lowered for these (abstract) inputs, one per window, for ahead-of-time compilation."""
        index, inv = self.consts()[0]
        first = {win: layers[self.windows.index(win)] for win in self.blocks}
        return [self.blocks[win].lower(x, pool, first[win], index, inv, batch) for win in self.blocks]
