"""A checkpoint's ModelConfig: an HF config.json or GGUF metadata read through the family table (model/families.py),
the common fields here and each family's own from its entry."""

from __future__ import annotations

import json
import os

from sgjax.model.config import ModelConfig, RopeScaling, UnsupportedModelError
from sgjax.model.families import family_of_gguf, family_of_hf


def config_from_hf(d: dict, dtype: str = "float32") -> ModelConfig:
    """The config of an HF config.json: the common fields here, the family's own from its table entry."""
    fam = family_of_hf(d)
    num_heads = d["num_attention_heads"]
    common = dict(
        architecture=fam.name,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(d),
        rope_scaling=_rope_scaling_from_hf(_rope_params(d)),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", fam.tied_by_default)),
        qkv_bias=bool(d.get("attention_bias", False)),
        dtype=dtype,
    )
    return ModelConfig(**{**common, **fam.hf_config(d)})


def _rope_params(d: dict) -> dict | None:
    """The RoPE parameters of the global layers: `rope_scaling` (transformers 4) or `rope_parameters` (5), which
    may be per layer type ({"full_attention": {...}, "sliding_attention": {...}})."""
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if isinstance(rs, dict) and "full_attention" in rs:
        rs = rs["full_attention"]
    return rs


def _rope_theta(d: dict) -> float:
    params = _rope_params(d) if "rope_parameters" in d else {}
    return float(d.get("rope_theta") or (params or {}).get("rope_theta") or 10000.0)


def _rope_scaling_from_hf(rs: dict | None) -> RopeScaling:
    if not rs:
        return RopeScaling()
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rs["factor"]),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def config_from_hf_dir(path: str, dtype: str = "float32") -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        return config_from_hf(json.load(f), dtype)


def config_from_gguf(meta: dict, tensor_names: set[str], dtype: str = "float32") -> ModelConfig:
    arch = meta.get("general.architecture")
    fam = family_of_gguf(arch)

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    num_heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // num_heads)
    scaling_type = g("rope.scaling.type")
    scaling = RopeScaling()
    if scaling_type == "linear":
        scaling = RopeScaling(kind="linear", factor=float(g("rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError("GGUF rope_freqs tensors (llama3 scaling baked into the file) are not supported")
    vocab = g("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    common = dict(
        architecture=fam.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(g("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        dtype=dtype,
    )
    return ModelConfig(**{**common, **fam.gguf_config(g, common)})
