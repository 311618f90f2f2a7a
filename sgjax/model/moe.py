"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE): a router picks num_experts_per_tok experts per token,
the tokens are sorted by expert and the experts run as grouped matmuls (`jax.lax.ragged_dot`) over the sorted rows:
dropless (no capacity factor, no token is ever dropped) and with no [tokens, experts] dense intermediate.

Pure functions; `experts` takes the experts a device holds (all of them, or its expert-parallel share starting at
`first`), so the same code runs unsharded and under shard_map (engine/mesh.py `sharded_experts`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def default_kernel(platform: str) -> str:
    """The grouped matmuls a platform runs: the Pallas kernel on CUDA GPUs (it reads only the routed experts, where
    XLA's ragged_dot reads them all: docs/journal/architecture-models.md), ragged_dot elsewhere (the TPU's is a
    grouped-matmul kernel, the CPU has no Triton)."""
    return "pallas" if platform in ("gpu", "cuda") else "xla"


def route(h, router, cfg):
    """(weights [T, k] in h's dtype, expert ids i32[T, k]): softmax over the router logits in float32, the top k,
    renormalised when the family does (norm_topk_prob), as HF's routers compute them."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_w.astype(h.dtype), top_i.astype(jnp.int32)


def experts(
    h,
    top_w,
    top_i,
    w_gate,
    w_up,
    w_down,
    *,
    first=0,
    activation: str = "silu",
    out_dtype=None,
    kernel: str = "xla",
    kernel_config: dict | None = None,
):
    """sum_k top_w[t, k] * expert_{top_i[t, k]}(h[t]) over the experts held here, f32-accumulated, in h's dtype
    (or out_dtype: float32 for partial sums that a psum adds up).

    kernel "xla": jax.lax.ragged_dot; "pallas": kernels/grouped_matmul_gpu (interpret mode off the GPU), which
    reads only the routed experts' weights, with ragged_dot where its block sizes do not divide the shapes;
    kernel_config overrides its block sizes (probes).

    h [T, D]; w_gate, w_up [E_here, D, F]; w_down [E_here, F, D] are experts first .. first + E_here - 1. Each
    (token, choice) pair becomes one row; rows are sorted by expert (the pairs routed elsewhere sort last, in a group
    ragged_dot does not compute) and each expert's rows are one group of the grouped matmuls.
    """
    num_tokens, k = top_i.shape
    here = w_gate.shape[0]
    local = top_i.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < here), local, here)  # `here`: another device's expert
    order = jnp.argsort(local, stable=True)
    expert_of = local[order]
    token_of = order // k
    sizes = jnp.bincount(local, length=here + 1)[:here].astype(jnp.int32)
    with jax.named_scope("experts"):
        xs = h[token_of].astype(w_gate.dtype)  # bf16 experts under float32 activations (config.weight_dtype)
        if kernel == "pallas" and _pallas_fits(xs, w_gate, w_down, kernel_config):
            from sgjax.kernels import grouped_matmul_gpu as gmm

            interpret = jax.default_backend() not in ("gpu", "cuda")
            block_m = dict(gmm.default_config(xs.shape[0], here, xs.dtype), **(kernel_config or {}))["block_m"]
            tiles = gmm.tile_table(sizes, xs.shape[0], block_m)  # one table for both kernels
            run = dict(interpret=interpret, config=kernel_config, tiles=tiles)
            inner = gmm.gate_up(xs, w_gate, w_up, sizes, activation=activation, **run)
            ys = gmm.grouped_matmul(inner, w_down, sizes, out_dtype=jnp.float32, **run)
        elif kernel in ("xla", "pallas"):
            act = jax.nn.silu if activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
            gate = jax.lax.ragged_dot(xs, w_gate, sizes, preferred_element_type=jnp.float32)
            up = jax.lax.ragged_dot(xs, w_up, sizes, preferred_element_type=jnp.float32)
            inner = (act(gate) * up).astype(w_down.dtype)
            ys = jax.lax.ragged_dot(inner, w_down, sizes, preferred_element_type=jnp.float32)
        else:
            raise ValueError(f"moe kernel must be 'xla' or 'pallas', got {kernel!r}")
    # rows of no group here: whatever ragged_dot left there is dropped, not multiplied by 0 (0 * NaN is NaN)
    weight = top_w.reshape(-1)[order].astype(jnp.float32)
    ys = jnp.where((expert_of < here)[:, None], ys * weight[:, None], 0.0)
    return jnp.zeros((num_tokens, h.shape[1]), jnp.float32).at[token_of].add(ys).astype(out_dtype or h.dtype)


def _pallas_fits(xs, w_gate, w_down, kernel_config=None) -> bool:
    from sgjax.kernels import grouped_matmul_gpu as gmm

    (d, f), num_rows, num_groups = w_gate.shape[1:], xs.shape[0], w_gate.shape[0]
    config = dict(gmm.default_config(num_rows, num_groups, xs.dtype), **(kernel_config or {}))
    return gmm.supported(d, f, config) and gmm.supported(f, d, config)


def expert_counts(top_i, num_experts: int, valid):
    """i32[E]: how many (token, choice) pairs of the real rows (`valid` [T] bool) each expert got."""
    ids = jnp.where(valid[:, None], top_i, num_experts)
    return jnp.bincount(ids.reshape(-1), length=num_experts + 1)[:num_experts].astype(jnp.int32)


def moe_mlp(h, w, cfg, valid, experts_fn=None):
    """The MoE MLP of one layer: (output [T, D], expert token counts i32[E] of the real rows)."""
    top_w, top_i = route(h, w.router, cfg)
    fn = experts_fn or functools.partial(experts, activation=cfg.activation)
    out = fn(h, top_w, top_i, w.we_gate, w.we_up, w.we_down)
    return out, expert_counts(top_i, cfg.num_experts, valid)
