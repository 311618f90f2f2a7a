"""Tiny random HF checkpoints written with save_pretrained, for parity tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
              max_position_embeddings=512, rms_norm_eps=1e-6)

VARIANTS = {
    "llama-gqa4": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, rope_theta=10000.0)),
    "llama-mha-tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=8, tie_word_embeddings=True)),
    "llama-linear-rope": (LlamaConfig, LlamaForCausalLM,
                          dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM,
                    dict(num_key_value_heads=2, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(num_key_value_heads=2, tie_word_embeddings=False)),
}


def write_tiny(name: str, path: str, seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random norms and biases so that every parameter matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
