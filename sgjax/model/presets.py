"""Named tiny model configs for tests and benchmarks that run on random weights (`dummy_weights`).

They replace ad-hoc `ModelConfig(...)` literals, so that tests which use the same preset (and the same engine
settings) share the jitted step's compiled executables within a process: the step is cached per (ModelConfig,
attention backend), see sgjax/engine/runner.py `jitted_step`.
"""

from __future__ import annotations

from sgjax.model.config import ModelConfig

# A 2-layer Llama with GQA (4 query heads on 2 KV heads) and a 512-token vocabulary: engine loops, stress and
# overlap benchmarks without a tokenizer (input_ids in, output_ids out).
TINY_LLAMA = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)

# TINY_LLAMA with SmolLM2's vocabulary (49152 tokens, tied embeddings as SmolLM2's), so it runs with the real
# SmolLM2 tokenizer: text prompts, stop strings, grammars over the real vocabulary. For tests that compare sgjax
# with itself (overlap on and off, retraction, aborts, step shapes); HF parity stays on the real SmolLM2.
TINY_SMOLLM2_VOCAB = TINY_LLAMA.replace(vocab_size=49152, tie_word_embeddings=True)

# A 2-layer Qwen2 (q/k/v biases) with a 256-token vocabulary: the tensor-parallel check.
TINY_QWEN2 = ModelConfig(
    architecture="qwen2",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
)

# One layer, a 64-token vocabulary and a 64-token context: engine plumbing where even TINY_LLAMA's compile time
# would dominate (switch intervals, the step log).
MICRO_LLAMA = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=64,
)

# TINY_QWEN2 with SmolLM2's vocabulary (an untied head), for engine tests with the real tokenizer (tensor parallel).
TINY_QWEN2_SMOLLM2_VOCAB = TINY_QWEN2.replace(vocab_size=49152)

# A 2-layer Gemma 3 (a sliding layer of a 16-token window, then a global one; q/k and sandwich norms, GeGLU, the
# embedding scale, one KV head) with SmolLM2's vocabulary: the family's switches through the engine (tensor
# parallel, where its one KV head is copied to every device).
TINY_GEMMA3_SMOLLM2_VOCAB = ModelConfig(
    architecture="gemma3",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=True,
    qk_norm=True,
    sandwich_norms=True,
    activation="gelu_tanh",
    embed_scale=True,
    query_pre_attn_scalar=24.0,
    sliding_window=16,
    sliding_layers=(True, False),
    rope_local_theta=10000.0,
)
