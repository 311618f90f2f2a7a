"""Self-speculation (`--speculative-algorithm SELF`): the target's own first layers, then its final norm and head,
draft each decoding row's next k tokens greedily, one token a forward and k forwards in one jitted call; the step
then verifies them as it does NGRAM's drafts (ngram.accepted), so outputs are unchanged. It needs no extra weights,
so every model we load has a drafter; how often a shallow exit agrees with the whole model is measured, not assumed
(scripts/perf/bench_spec.py).

The draft writes its layers' keys and values at the positions the verify step writes next, in the same pool: for
those layers they are the target's own (same weights, same tokens), and the verify step writes every layer of them
again, so nothing a rejected draft leaves is ever read. The scheduler grows each row's pages for the verify step
before it drafts, so the draft's slots exist.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgjax.engine import mesh as tp
from sgjax.engine.plan import StepPlan
from sgjax.engine.programs import ops_for
from sgjax.engine.shared import Shared
from sgjax.kernels import get_backend
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.model.batch import StepBatch
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward


def draft_layers(args, cfg: ModelConfig) -> int:
    """The layers that draft: --speculative-draft-layers, else half the model's (at least one, fewer than all)."""
    n = args.speculative_draft_layers or max(1, cfg.num_layers // 2)
    if not 1 <= n < cfg.num_layers:
        raise ValueError(
            f"speculative_draft_layers must be in [1, {cfg.num_layers - 1}] for a {cfg.num_layers}-layer model, got {n}"
        )
    return n


def _jitted_draft(cfg: ModelConfig, plan: StepPlan, mesh, page: int, layers: int, k: int):
    """(weights, pool, batch) -> (drafts i32[num_reqs, k], pool): batch is a decode step of each row's newest token
    (one token per request, request r at token row r); the pool is donated."""
    attend = get_backend(plan.attention)
    if mesh is not None:
        attend = tp.sharded_attention(attend, mesh)
    experts_fn = tp.experts_for(cfg, mesh, plan.moe_kernel, plan.expert_parallel)
    ops = ops_for(plan)

    def draft(weights, pool, batch: StepBatch):
        a = batch.attn
        num_tokens, num_reqs = batch.input_ids.shape[0], a.kv_lens.shape[0]
        rows = jnp.arange(num_tokens)
        real = rows < a.cu_q_lens[-1]  # token row r is request r's newest token
        req = jnp.minimum(rows, num_reqs - 1)

        def one(carry, i):
            pool, ids = carry
            pos = jnp.where(real, batch.positions + i, 0)
            slots = a.page_table[req, pos // page] * page + pos % page
            step = StepBatch(
                input_ids=ids,
                positions=pos,
                attn=AttentionMetadata(
                    slot_mapping=jnp.where(real, slots, a.slot_mapping),
                    cu_q_lens=a.cu_q_lens,
                    kv_lens=jnp.where(a.kv_lens > 0, a.kv_lens + i, 0),
                    page_table=a.page_table,
                ),
                logits_idx=batch.logits_idx,
            )
            logits, pool = forward(
                weights, pool, step, cfg=cfg, attention=attend, ops=ops, experts_fn=experts_fn, first_layers=layers
            )
            if mesh is not None:
                logits = jax.lax.with_sharding_constraint(logits, tp.replicated(mesh))
            picked = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [num_logits]: request r's at r
            n = min(num_tokens, picked.shape[0])
            nxt = jnp.zeros(num_tokens, jnp.int32).at[:n].set(picked[:n])
            return (pool, jnp.where(real, nxt, 0)), picked

        (pool, _), drafts = jax.lax.scan(one, (pool, batch.input_ids), jnp.arange(k, dtype=jnp.int32))
        if mesh is not None:
            pool = jax.lax.with_sharding_constraint(pool, tp.pool_sharding(mesh))
        return drafts.T, pool

    return jax.jit(draft, donate_argnums=1)


# one per (model, plan, mesh, page size, layers, k) while a runner holds it (engine/shared.py: compiled programs are
# bounded by the process's memory maps)
DRAFTS = Shared(_jitted_draft, keep=1)


def jitted_draft(cfg: ModelConfig, plan: StepPlan, mesh, page: int, layers: int, k: int):
    return DRAFTS(cfg, plan.program(), mesh, page, layers, k)
