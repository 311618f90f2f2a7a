"""The parameter pytree: per-layer weights stacked on a leading layer axis (scanned over).

Matrices are stored (in, out) so the forward is `x @ w`. Every leaf has logical axis names
(`LOGICAL_AXES`) so that a sharding rule table can place them on a mesh without touching the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model.config import ModelConfig

Array = Any


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    """One transformer block, every array with a leading [num_layers] axis."""

    attn_norm: Array  # [L, D]
    wq: Array  # [L, D, Hq*hd]
    wk: Array  # [L, D, Hkv*hd]
    wv: Array  # [L, D, Hkv*hd]
    wo: Array  # [L, Hq*hd, D]
    mlp_norm: Array  # [L, D]
    w_gate: Array  # [L, D, F]
    w_up: Array  # [L, D, F]
    w_down: Array  # [L, F, D]
    bq: Array | None = None  # [L, Hq*hd] (Qwen2)
    bk: Array | None = None
    bv: Array | None = None


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    embed: Array  # [V, D]
    layers: LayerWeights | tuple[LayerWeights, ...]  # stacked (scanned) or per layer (unrolled)
    final_norm: Array  # [D]
    lm_head: Array | None = None  # [D, V]; None when tied to embed


LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "q_heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "wo": ("layers", "q_heads", "embed"),
    "bq": ("layers", "q_heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}


def logical_axes(weights: Weights) -> Weights:
    """A Weights-shaped pytree of logical axis-name tuples (None where the leaf is None)."""
    def axes_of(obj, drop_layer_axis=False):
        return {f.name: LOGICAL_AXES[f.name][drop_layer_axis:] if getattr(obj, f.name) is not None else None
                for f in dataclasses.fields(obj) if f.name != "layers"}

    if isinstance(weights.layers, (tuple, list)):
        layers = tuple(LayerWeights(**axes_of(w, True)) for w in weights.layers)
    else:
        layers = LayerWeights(**axes_of(weights.layers))
    return Weights(layers=layers, **axes_of(weights))


def unstack_layers(weights: Weights) -> Weights:
    """Per-layer weights for an unrolled forward (the GPU layout: see llama.forward)."""
    if isinstance(weights.layers, (tuple, list)):
        return weights
    n = weights.layers.wq.shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(n))
    return dataclasses.replace(weights, layers=layers)


def layer_loop_for(platform: str) -> str:
    """'unrolled' on accelerators (weight traffic), 'scan' on CPU (compile time in tests and CI)."""
    return "scan" if platform == "cpu" else "unrolled"


def for_platform(weights: Weights, platform: str) -> Weights:
    return unstack_layers(weights) if layer_loop_for(platform) == "unrolled" else weights


def shardings(weights: Weights, mesh: jax.sharding.Mesh, rules: Mapping[str, str | None]) -> Weights:
    """NamedShardings from logical axes and a rule table, e.g. {"q_heads": "tensor", "mlp": "tensor"}."""
    P = jax.sharding.PartitionSpec
    axes = logical_axes(weights)
    return jax.tree.map(lambda names: jax.sharding.NamedSharding(mesh, P(*(rules.get(n) for n in names))),
                        axes, is_leaf=lambda x: isinstance(x, tuple))


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    s = {"embed": (V, D), "final_norm": (D,), "attn_norm": (L, D), "mlp_norm": (L, D),
         "wq": (L, D, cfg.q_size), "wk": (L, D, cfg.kv_size), "wv": (L, D, cfg.kv_size), "wo": (L, cfg.q_size, D),
         "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
    if cfg.qkv_bias:
        s.update(bq=(L, cfg.q_size), bk=(L, cfg.kv_size), bv=(L, cfg.kv_size))
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (D, V)
    return s


def assemble(cfg: ModelConfig, arrays: Mapping[str, Any]) -> Weights:
    """Weights from a flat dict of our names, checking every shape against the config."""
    expected = shapes(cfg)
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {missing}")
    dtype = jnp.dtype(cfg.dtype)
    out = {}
    for name, shape in expected.items():
        a = arrays[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, the config expects {shape}")
        out[name] = jnp.asarray(a, dtype=dtype)
    layer_names = {f.name for f in dataclasses.fields(LayerWeights)}
    layers = LayerWeights(**{k: v for k, v in out.items() if k in layer_names})
    return Weights(layers=layers, **{k: v for k, v in out.items() if k not in layer_names})


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """Random weights of the config's real shapes, generated on device (for performance runs)."""
    expected = shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(expected))
        out = {}
        for k, (name, shape) in zip(keys, expected.items()):
            if name.endswith("norm"):
                out[name] = jnp.ones(shape, dtype)
            else:
                fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else shape[-1]
                out[name] = (jax.random.normal(k, shape, jnp.float32) * (fan_in ** -0.5)).astype(dtype)
        return out

    arrays = init(jax.random.PRNGKey(seed))
    layer_names = {f.name for f in dataclasses.fields(LayerWeights)}
    layers = LayerWeights(**{k: v for k, v in arrays.items() if k in layer_names})
    return Weights(layers=layers, **{k: v for k, v in arrays.items() if k not in layer_names})


_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv", "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_HF_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}


def from_hf_state_dict(cfg: ModelConfig, get: Any, names: set[str]) -> Weights:
    """Weights from HF tensor names; `get(name)` returns a numpy array in torch layout (out, in)."""
    per_layer: dict[str, list] = {v: [None] * cfg.num_layers for v in _HF_LAYER.values()}
    flat: dict[str, Any] = {}
    for name in names:
        if name in _HF_TOP:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            a = get(name)
            flat[_HF_TOP[name]] = a.T if name == "lm_head.weight" else a
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 4:
            continue  # e.g. rotary inv_freq buffers
        key = ".".join(parts[3:])
        if key not in _HF_LAYER:
            continue
        ours = _HF_LAYER[key]
        i = int(parts[2])
        if i >= cfg.num_layers:
            raise ValueError(f"tensor {name!r} is for layer {i}, the config has {cfg.num_layers} layers")
        a = get(name)
        per_layer[ours][i] = a.T if a.ndim == 2 else a
    for ours, items in per_layer.items():
        present = [x is not None for x in items]
        if all(present):
            flat[ours] = np.stack(items)
        elif any(present):
            missing = [i for i, p in enumerate(present) if not p]
            raise ValueError(f"checkpoint has {ours} for some layers but not for layers {missing}")
    return assemble(cfg, flat)


def to_hf_state_dict(cfg: ModelConfig, weights: Weights, convert: Any = np.asarray) -> dict[str, Any]:
    """HF tensor names -> convert(tensor in torch layout (out, in)): the inverse of from_hf_state_dict (benchmarks
    give HF transformers the same dummy weights). A tied head has no lm_head entry."""
    out: dict[str, Any] = {}
    for hf_name, ours in _HF_TOP.items():
        a = getattr(weights, ours)
        if a is not None:
            out[hf_name] = convert(a.T if ours == "lm_head" else a)
    hf_layer = {v: k for k, v in _HF_LAYER.items()}
    stacked = not isinstance(weights.layers, (tuple, list))
    for i in range(cfg.num_layers):
        layer = weights.layers if stacked else weights.layers[i]
        for f in dataclasses.fields(LayerWeights):
            a = getattr(layer, f.name)
            if a is None:
                continue
            a = a[i] if stacked else a
            out[f"model.layers.{i}.{hf_layer[f.name]}"] = convert(a.T if a.ndim == 2 else a)
    return out
