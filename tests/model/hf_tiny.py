"""Tiny random HF checkpoints written with save_pretrained, for parity tests."""

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "llama-gqa4": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, rope_theta=10000.0)),
    "llama-mha-tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=8, tie_word_embeddings=True)),
    "llama-linear-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    ),
    "llama3-rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-qk-norm": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # windows of a few tokens, so the tests' 7-17 token prompts, cached prefixes and decodes cross their edge
    "mistral-window": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=5)),
    "gemma3-local-global": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    "gemma2-softcap": (
        Gemma2Config,
        Gemma2ForCausalLM,
        dict(
            num_key_value_heads=4,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "phi3-fused": (Phi3Config, Phi3ForCausalLM, dict(num_key_value_heads=2, pad_token_id=0, sliding_window=None)),
    # mixtures of experts: more experts than a 7-17 token prompt's rows reach, so some get no tokens
    "qwen3-moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "mixtral-moe": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    ),
    "olmoe-moe": (
        OlmoeConfig,
        OlmoeForCausalLM,
        dict(
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=3,
            intermediate_size=32,
            clip_qkv=1.5,
            eos_token_id=2,
        ),
    ),
}
MOE_VARIANTS = ("qwen3-moe", "mixtral-moe", "olmoe-moe")


def write_tiny(name: str, path: str, seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(seed)
    # eager: the attention that applies Gemma 2's soft cap (sdpa leaves it out)
    model = model_cls(config_cls(**{**COMMON, **extra}, attn_implementation="eager")).eval()
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith("gate.weight") and p.ndim == 2 and p.shape[0] < p.shape[1]:
                p.copy_(torch.randn_like(p))  # a router far from uniform: no near-ties in the top k
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
