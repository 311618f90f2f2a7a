"""Model configuration: what a checkpoint says about its model (model/checkpoint.py reads it from an HF config.json
or GGUF metadata), and the shapes of the large models the benchmarks run with dummy weights.

Frozen and hashable: the config is a static argument of the jitted step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature this runtime does not implement."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family (model/families.py): llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, and
    # the mixtures of experts qwen3_moe, mixtral, olmoe
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # The params' float dtype and the activations' (the dtype the model was loaded in). How a run narrows its matrices
    # or its KV pool is the step plan's (engine/plan.py), never the checkpoint's.
    dtype: str = "float32"
    # The few blocks a family changes (their defaults are Llama's).
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's q and k before RoPE
    sandwich_norms: bool = False  # Gemma 2/3: the attention and MLP outputs are normed too, before the residual
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 instead of head_dim's
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    sliding_window: int | None = None  # keys within this many positions of the query, on the sliding layers
    sliding_layers: tuple[bool, ...] = ()  # per layer; () with a window: every layer slides (Mistral)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (rope_scaling is the global's)
    qk_norm_per_head: bool = True  # False (OLMoE): the q/k norms span the whole projection, before the head split
    qkv_clip: float | None = None  # OLMoE's clip_qkv: q, k, v clamped to [-clip, clip]
    # Mixture of experts (model/moe.py): every layer's MLP is num_experts experts of width moe_intermediate_size, of
    # which a router picks num_experts_per_tok per token; 0 experts: the dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.rope_scaling.kind not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope scaling {self.rope_scaling.kind!r} is not supported")
        if self.activation not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"activation {self.activation!r} is not supported (silu, gelu_tanh)")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise UnsupportedModelError(
                f"a mixture of {self.num_experts} experts needs 0 < num_experts_per_tok <= num_experts (got "
                f"{self.num_experts_per_tok}) and a moe_intermediate_size (got {self.moe_intermediate_size})"
            )

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sm_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in positions; 0: it attends to the whole context."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if not self.sliding_layers or self.sliding_layers[layer] else 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_width(self) -> int:
        """The width one MLP (or one expert) splits under tensor parallelism."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    def num_params(self, active: bool = False) -> int:
        """Parameters; active=True: those one token reads (its num_experts_per_tok experts, not all of them)."""
        d, L = self.hidden_size, self.num_layers
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        qk = (self.q_size + self.kv_size) if not self.qk_norm_per_head else 2 * self.head_dim
        norms = 2 * d + (2 * d if self.sandwich_norms else 0) + (qk if self.qk_norm else 0)
        if self.is_moe:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        else:
            mlp = 3 * d * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * (attn + mlp + norms) + d + head


def llama3_8b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Llama-3-8B's shapes, for performance runs with dummy weights."""
    return ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        dtype=dtype,
    )


def qwen3_8b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Qwen3-8B's shapes (q/k norms, untied head), for performance runs with dummy weights."""
    return ModelConfig(
        architecture="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        dtype=dtype,
    )


def gemma3_12b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Gemma-3-12B's text shapes (5 sliding layers of 1024 keys : 1 global, head_dim 256), for performance runs."""
    return ModelConfig(
        architecture="gemma3",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=RopeScaling(kind="linear", factor=8.0),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
        query_pre_attn_scalar=256.0,
        sliding_window=1024,
        sliding_layers=tuple((i + 1) % 6 != 0 for i in range(48)),
        rope_local_theta=10000.0,
        dtype=dtype,
    )


def mixtral_8x7b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Mixtral-8x7B's shapes (8 experts of 14336, 2 per token), for performance runs with dummy weights."""
    return ModelConfig(
        architecture="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=14336,
        norm_topk_prob=True,
        dtype=dtype,
    )


def qwen3_30b_a3b_config(dtype: str = "bfloat16") -> ModelConfig:
    """Qwen3-30B-A3B's shapes (128 experts of 768, 8 per token, q/k norms), for performance runs."""
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        dtype=dtype,
    )


# Dummy-weight shapes for benchmarks, by name (scripts/perf/bench_forward.py --model).
BENCH_CONFIGS = {
    "llama3-8b": llama3_8b_config,
    "qwen3-8b": qwen3_8b_config,
    "gemma3-12b": gemma3_12b_config,
    "mixtral-8x7b": mixtral_8x7b_config,
    "qwen3-30b-a3b": qwen3_30b_a3b_config,
}
