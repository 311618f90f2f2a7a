"""Whole-prompt readouts of the last token, from a prefill over a scratch KV pool of its own (the serving pool and
the radix cache are untouched):
- embeddings: the final normed hidden state, L2-normalized (last-token pooling, as decoder-only embedding models and
  SGLang's pooler for them do; OpenAI's vectors are unit length too);
- next-token log-probabilities over the whole vocabulary (SGLang's /v1/score reads its label tokens from them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine import mesh as tp
from sgjax.engine.buckets import bucket
from sgjax.engine.plan import StepPlan
from sgjax.engine.programs import forward_parts
from sgjax.engine.shared import Shared
from sgjax.kernels import allocate_pool
from sgjax.model.batch import build_batch
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward

# What a readout returns; the index is its code in a multi-host READOUT broadcast (engine/distributed.py).
READOUTS = ("embedding", "logprobs")


def _jitted_readout(cfg: ModelConfig, plan: StepPlan, readout: str, mesh=None):
    """With a mesh: attention under shard_map over the heads as in the step (a Pallas kernel cannot be split by
    GSPMD), and a replicated output, so each process reads its own copy. `plan`: the step plan's program part."""
    attend, experts_fn, ops = forward_parts(cfg, plan, mesh)

    def run(weights, pool, batch):
        if readout == "logprobs":
            logits, _ = forward(weights, pool, batch, cfg=cfg, attention=attend, ops=ops, experts_fn=experts_fn)
            out = jax.nn.log_softmax(logits, axis=-1)
        else:
            hidden, _ = forward(
                weights, pool, batch, cfg=cfg, attention=attend, ops=ops, output="hidden", experts_fn=experts_fn
            )
            out = hidden / jnp.maximum(jnp.linalg.norm(hidden, axis=-1, keepdims=True), 1e-12)
        if mesh is not None:
            out = jax.lax.with_sharding_constraint(out, tp.replicated(mesh))
        return out

    return jax.jit(run)


jitted_readout = Shared(_jitted_readout, keep=2)  # the few readouts asked for last (engine/shared.py)


def readout(
    cfg: ModelConfig,
    weights,
    plan: StepPlan,
    page_size: int,
    prompts: list[list[int]],
    kind: str,
    mesh=None,
    to_device=jnp.asarray,
) -> np.ndarray:
    """[len(prompts), hidden] float32 unit vectors (kind "embedding") or [len(prompts), vocab] float32
    log p(next token | prompt) ("logprobs"). `to_device` places a host input (across hosts: each process its own
    devices' copies, Runner._to_device). Shapes are bucketed (tokens, requests, pages) as steps are."""
    pages = [-(-len(p) // page_size) for p in prompts]
    width = bucket(max(pages), 4)
    num_reqs = bucket(len(prompts), 4)
    tables, nxt = [], 1  # page 0 is the null page
    for n in pages:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    num_pages = bucket(nxt, 16)
    batch = build_batch(
        [list(p) for p in prompts],
        [len(p) for p in prompts],
        tables,
        page_size,
        bucket(sum(map(len, prompts)), 16),
        num_reqs,
        width,
    )
    pool = allocate_pool(
        cfg.num_layers,
        num_pages,
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype=jnp.dtype(plan.kv_dtype),
        sharding=None if mesh is None else tp.pool_sharding(mesh),
    )
    out = jitted_readout(cfg, plan.program(), kind, mesh)(weights, pool, jax.tree.map(to_device, batch))
    local = out if out.is_fully_addressable else out.addressable_data(0)
    return np.asarray(local)[: len(prompts)]
