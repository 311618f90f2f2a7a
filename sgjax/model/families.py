"""The model families, one table entry each: how a family's HF config.json and GGUF metadata map to ModelConfig,
where its checkpoint names differ from the Llama names in weights.LEAVES, and what its loader must do to the
tensors (fused projections to split, Gemma's (1 + w) norm scales). The blocks a family changes are ModelConfig
fields that the one decoder (model/llama.py) reads; adding a family is an entry here and, at most, a new field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from sgjax.model.config import UnsupportedModelError


def rope_theta_of(d: dict, layer_type: str, default: float) -> float:
    """A layer type's RoPE base from transformers 5's per-type rope_parameters."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        return float(params[layer_type].get("rope_theta", default))
    return default


def _no_extra(d: dict) -> dict:
    return {}


def _no_gguf(g, common) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    hf_config: Callable[[dict], dict] = _no_extra  # ModelConfig fields beyond the common ones
    gguf_config: Callable[..., dict] = _no_gguf  # the same from GGUF metadata: (get(key, default), common fields)
    hf_names: Mapping[str, str] = field(default_factory=dict)  # leaf -> HF name, where not the Llama name
    gguf_names: Mapping[str, str] = field(default_factory=dict)  # leaf -> GGUF name, where not the Llama name
    # HF tensor (under model.layers.{i}.) -> the leaves it holds, stacked on its output axis (Phi-3's qkv_proj)
    hf_fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # HF's Gemma norms hold w for a (1 + w) scale; sgjax stores the scale itself (as GGUF files do), so the forward
    # has one RMSNorm for every family.
    norm_plus_one: bool = False
    gguf_unpermute_qk: bool = False  # llama.cpp's converter interleaves Llama's rotary halves
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say
    chat_template: str | None = None  # a built-in (model/chat_templates.py) for checkpoints that carry none


def _mistral(d: dict) -> dict:
    return {"sliding_window": d.get("sliding_window") or None}


def _qwen2(d: dict) -> dict:
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise UnsupportedModelError("Qwen2 with use_sliding_window (max_window_layers) is not supported")
    return {"qkv_bias": True}


def _qwen3(d: dict) -> dict:
    if d.get("use_sliding_window") and d.get("sliding_window"):
        raise UnsupportedModelError("Qwen3 with use_sliding_window (max_window_layers) is not supported")
    return {"qk_norm": True}


def _layer_types(d: dict, pattern: int) -> tuple[bool, ...]:
    """Which layers slide: transformers 5's layer_types, or every layer but each pattern-th (older configs)."""
    types = d.get("layer_types")
    if types:
        return tuple(t == "sliding_attention" for t in types)
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or pattern
    return tuple((i + 1) % pattern != 0 for i in range(d["num_hidden_layers"]))


def _gemma_act(d: dict) -> str:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        raise UnsupportedModelError(f"Gemma activation {act!r} is not supported (gelu_pytorch_tanh)")
    return "gelu_tanh"  # HF's Gemma configs that say "gelu" run the tanh approximation too


def _gemma2(d: dict) -> dict:
    return {
        "sandwich_norms": True,
        "activation": _gemma_act(d),
        "embed_scale": True,
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or d.get("head_dim") or 256),
        "attn_softcap": d.get("attn_logit_softcapping"),
        "final_softcap": d.get("final_logit_softcapping"),
        "sliding_window": d.get("sliding_window") or None,
        "sliding_layers": _layer_types(d, 2) if d.get("sliding_window") else (),
    }


def _gemma3(d: dict) -> dict:
    out = _gemma2(d)
    out.update(
        qk_norm=True,
        sliding_layers=_layer_types(d, 6) if d.get("sliding_window") else (),
        rope_local_theta=rope_theta_of(d, "sliding_attention", float(d.get("rope_local_base_freq", 10000.0))),
    )
    return out


def _gemma3_gguf(g, common) -> dict:
    # llama.cpp's gemma3 graph, which the file relies on: 5 sliding layers then a global one, a 10000 base on the
    # sliding layers, scores scaled by head_dim's -1/2 except on the 27B (62 layers: hidden / heads).
    layers = common["num_layers"]
    scalar = common["hidden_size"] / common["num_heads"] if layers == 62 else common["head_dim"]
    window = g("attention.sliding_window")
    return {
        "qk_norm": True,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "embed_scale": True,
        "query_pre_attn_scalar": float(scalar),
        "sliding_window": int(window) if window else None,
        "sliding_layers": tuple((i + 1) % 6 != 0 for i in range(layers)) if window else (),
        "rope_local_theta": 10000.0,
        "tie_word_embeddings": common["tie_word_embeddings"],
    }


def _phi3(d: dict) -> dict:
    params = d.get("rope_parameters") or {}
    partial = d.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head)")
    return {"sliding_window": d.get("sliding_window") or None}


def _experts(d: dict, width: int, norm_topk: bool) -> dict:
    num = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 saves Qwen3-MoE's as the latter
    return {
        "num_experts": int(num),
        "num_experts_per_tok": int(d["num_experts_per_tok"]),
        "moe_intermediate_size": int(width),
        "norm_topk_prob": bool(norm_topk),
    }


def _qwen3_moe(d: dict) -> dict:
    out = _qwen3(d)
    if d.get("mlp_only_layers") or (d.get("decoder_sparse_step") or 1) != 1:
        raise UnsupportedModelError(
            "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step > 1) is not "
            "supported: every layer must be sparse"
        )
    return {**out, **_experts(d, d["moe_intermediate_size"], d.get("norm_topk_prob", False))}


def _mixtral(d: dict) -> dict:  # softmax, top k, renormalised: HF's MixtralTopKRouter
    return {**_mistral(d), **_experts(d, d["intermediate_size"], True)}


def _olmoe(d: dict) -> dict:  # q/k norms over the whole projections, optional clamp
    return {
        "qk_norm": True,
        "qk_norm_per_head": False,
        "qkv_clip": d.get("clip_qkv"),
        **_experts(d, d["intermediate_size"], d.get("norm_topk_prob", False)),
    }


_MIXTRAL_NAMES = {
    "router": "block_sparse_moe.gate.weight",
    "we_gate": "block_sparse_moe.experts.{e}.w1.weight",
    "we_up": "block_sparse_moe.experts.{e}.w3.weight",
    "we_down": "block_sparse_moe.experts.{e}.w2.weight",
}
_GEMMA_NAMES = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_GEMMA_GGUF = {"post_attn_norm": "post_attention_norm.weight", "post_mlp_norm": "post_ffw_norm.weight"}

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",), ("llama",), gguf_unpermute_qk=True),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), hf_config=_mistral),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), hf_config=_qwen2),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        ("qwen3",),
        hf_config=_qwen3,
        gguf_config=lambda g, common: {"qk_norm": True},
    ),
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        hf_config=_gemma2,
        hf_names=_GEMMA_NAMES,
        norm_plus_one=True,
        tied_by_default=True,
        chat_template="gemma",
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        ("gemma3_text",),
        ("gemma3",),
        hf_config=_gemma3,
        gguf_config=_gemma3_gguf,
        hf_names=_GEMMA_NAMES,
        gguf_names=_GEMMA_GGUF,
        norm_plus_one=True,
        tied_by_default=True,
        chat_template="gemma",
    ),
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        ("phi3",),
        hf_config=_phi3,
        hf_fused={"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("w_gate", "w_up")},
    ),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), hf_config=_qwen3_moe),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), hf_config=_mixtral, hf_names=_MIXTRAL_NAMES),
    Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), hf_config=_olmoe),
)
FAMILY = {f.name: f for f in FAMILIES}


def hf_config_dict(cfg) -> dict:
    """The HF config.json of a ModelConfig, the inverse of config_from_hf: benchmarks build HF's own model over
    sgjax's weights (scripts/bench/hf_backend.py), and tests check the round trip."""
    fam = FAMILY[cfg.architecture]
    d = {
        "architectures": [fam.hf_architectures[0]],
        "model_type": fam.hf_model_types[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias and fam.name != "qwen2",
        "rope_theta": cfg.rope_theta,
        "sliding_window": cfg.sliding_window,
        "pad_token_id": None,
    }
    rs = cfg.rope_scaling
    if rs.kind == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
    elif rs.kind == "llama3":
        d["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    if fam.name == "mixtral" and cfg.head_dim == cfg.hidden_size // cfg.num_heads:
        d["head_dim"] = None  # what Mixtral's own configs say (hidden_size / heads)
    if cfg.is_moe:
        d.update(
            num_experts_per_tok=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            **{"num_local_experts" if fam.name == "mixtral" else "num_experts": cfg.num_experts},
        )
        if fam.name == "qwen3_moe":
            d.update(moe_intermediate_size=cfg.moe_intermediate_size, mlp_only_layers=[], decoder_sparse_step=1)
        if fam.name == "olmoe":
            d["clip_qkv"] = cfg.qkv_clip
    if fam.name in ("gemma2", "gemma3"):
        scalar = cfg.query_pre_attn_scalar
        d.update(
            query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.final_softcap,
            hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)],
        )
        if fam.name == "gemma3":
            d["rope_local_base_freq"] = cfg.rope_local_theta
    return d


def family_of_hf(d: dict) -> Family:
    archs = d.get("architectures") or []
    for f in FAMILIES:
        if any(a in f.hf_architectures for a in archs):
            return f
    for f in FAMILIES:
        if d.get("model_type") in f.hf_model_types:
            return f
    known = sorted(a for f in FAMILIES for a in f.hf_architectures)
    raise UnsupportedModelError(f"architecture {archs or d.get('model_type')!r} is not supported (supported: {known})")


def family_of_gguf(arch: str | None) -> Family:
    for f in FAMILIES:
        if arch in f.gguf_architectures:
            return f
    known = sorted(a for f in FAMILIES for a in f.gguf_architectures)
    raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported ({', '.join(known)})")
