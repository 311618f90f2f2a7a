"""The mixture-of-experts block (model/moe.py) against a dense numpy reference, and the MoE families' configs."""

import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.model.checkpoint import config_from_hf
from sgjax.model.config import ModelConfig, UnsupportedModelError
from sgjax.model.families import hf_config_dict
from sgjax.model.moe import expert_counts, experts, route

E, D, F, T = 6, 8, 5, 9


def _reference(h, top_w, top_i, wg, wu, wd):
    """Token by token, choice by choice: sum_k w * down(silu(gate(x)) * up(x))."""
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(top_w[t], top_i[t]):
            g, u = h[t] @ wg[e], h[t] @ wu[e]
            out[t] += w * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((T, D)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, D, F)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((E, F, D)).astype(np.float32)
    # experts 1 and 4 get no tokens; token 0 picks the same expert twice
    top_i = rng.choice([0, 2, 3, 5], size=(T, 2)).astype(np.int32)
    top_i[0] = [3, 3]
    top_w = rng.random((T, 2)).astype(np.float32)
    return h, top_w, top_i, wg, wu, wd


def test_experts_match_dense_reference(arrays):
    h, top_w, top_i, wg, wu, wd = arrays
    out = experts(*map(jnp.asarray, arrays))
    np.testing.assert_allclose(np.asarray(out), _reference(*arrays), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shards", [2, 3])
def test_expert_shards_sum_to_the_whole(arrays, shards):
    """Expert parallelism's local step: each shard computes only its experts (`first` ..), the shards add up."""
    h, top_w, top_i, wg, wu, wd = arrays
    per = E // shards
    parts = [
        experts(
            jnp.asarray(h),
            jnp.asarray(top_w),
            jnp.asarray(top_i),
            jnp.asarray(wg[s * per : (s + 1) * per]),
            jnp.asarray(wu[s * per : (s + 1) * per]),
            jnp.asarray(wd[s * per : (s + 1) * per]),
            first=s * per,
        )
        for s in range(shards)
    ]
    np.testing.assert_allclose(np.asarray(sum(parts)), _reference(*arrays), rtol=1e-5, atol=1e-5)


def test_route_top_k_and_renormalisation():
    cfg = ModelConfig(
        "qwen3_moe",
        16,
        8,
        8,
        1,
        2,
        2,
        4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        norm_topk_prob=True,
    )
    h = jnp.eye(8)[:3]
    router = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)
    w, i = route(h, router, cfg)
    probs = np.exp(np.asarray(router[:3]))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    np.testing.assert_array_equal(np.asarray(i), top)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    w_raw, _ = route(h, router, cfg.replace(norm_topk_prob=False))
    np.testing.assert_allclose(np.asarray(w_raw), np.take_along_axis(probs, top, -1), rtol=1e-5)


def test_expert_counts_leave_out_padding():
    top_i = jnp.asarray([[0, 2], [2, 2], [1, 0]], jnp.int32)
    valid = jnp.asarray([True, True, False])
    np.testing.assert_array_equal(np.asarray(expert_counts(top_i, 4, valid)), [1, 0, 3, 0])


def test_moe_configs_from_hf():
    base = {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    q = config_from_hf(
        {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 12,
            "norm_topk_prob": True,
        }
    )
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob, q.qk_norm) == (
        8,
        2,
        12,
        True,
        True,
    )
    m = config_from_hf(
        {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    )
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob) == (4, 64, True)
    o = config_from_hf(
        {**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 3.0}
    )
    assert (o.qk_norm, o.qk_norm_per_head, o.qkv_clip, o.norm_topk_prob) == (True, False, 3.0, False)
    for cfg in (q, m, o):  # benchmarks hand HF our config back
        assert config_from_hf(hf_config_dict(cfg)) == cfg
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        config_from_hf(
            {
                **base,
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 12,
                "mlp_only_layers": [0],
            }
        )
    assert q.num_params(active=True) < q.num_params()
