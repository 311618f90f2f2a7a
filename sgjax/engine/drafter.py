"""Speculation with a model drafting on the device: each decoding row's next k tokens, greedily, one token a forward
and k forwards in one jitted call, once the scheduler has grown the pages the verify step writes (so the draft's
slots exist); the step then verifies them as it does NGRAM's drafts (ngram.accepted), so outputs are unchanged.

- `SELF` (self-speculation): the target's own first layers, then its final norm and head. No extra weights, so every
  model we load has a drafter; how often a shallow exit agrees with the whole model is measured, not assumed
  (scripts/perf/bench_spec.py). The draft writes its layers' KV at the positions the verify step writes next, in
  the same pool: for those layers they are the target's own (same weights, same tokens), and the verify step
  writes every layer of them again, so nothing a rejected draft leaves is ever read.
- `STANDALONE`: a smaller model with the target's vocabulary (`--speculative-draft-model-path`), its KV in a pool of
  its own over the same page numbers (the target's allocator and radix cache own the pages; the pool is sized for
  both). It catches up lazily: each draft first reads the row's tokens past `Req.draft_kv_len` (a new, resumed or
  retracted request reads its whole prefix once), then drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgjax.engine import mesh as tp
from sgjax.engine.plan import StepPlan
from sgjax.engine.programs import forward_parts
from sgjax.engine.shared import Shared
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.model.batch import StepBatch
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward


def load_draft(args, cfg: ModelConfig):
    """STANDALONE's draft model as (cfg, plan, weights), loaded as the target is (its own step plan from the same
    flags), in the target's dtype; it must share the target's vocabulary and run on one device."""
    from dataclasses import replace

    from sgjax.engine.loading import block_dtype, load_model_cached
    from sgjax.engine.plan import Machine, resolve
    from sgjax.model.loader import load_config

    path = args.speculative_draft_model_path
    if not path:
        raise ValueError("speculative_algorithm STANDALONE needs --speculative-draft-model-path")
    if args.tp_size > 1 or args.nnodes > 1:
        raise ValueError("speculative_algorithm STANDALONE runs on one device (tp_size 1, nnodes 1)")
    dcfg = load_config(path, cfg.dtype)
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"speculative_draft_model_path: the draft's vocabulary ({dcfg.vocab_size} tokens) must be the "
            f"target's ({cfg.vocab_size})"
        )
    dargs = replace(args, model_path=path, speculative_algorithm=None, quantization_param_path=None)  # the target's
    plan = resolve(dargs, dcfg, Machine.here(), block_dtype=block_dtype(path))
    dcfg, weights = load_model_cached(path, cfg.dtype, plan=plan)
    return dcfg, plan, weights


def draft_layers(args, cfg: ModelConfig) -> int:
    """The layers that draft: --speculative-draft-layers, else half the model's (at least one, fewer than all)."""
    n = args.speculative_draft_layers or max(1, cfg.num_layers // 2)
    if not 1 <= n < cfg.num_layers:
        raise ValueError(
            f"speculative_draft_layers must be in [1, {cfg.num_layers - 1}] for a {cfg.num_layers}-layer model, got {n}"
        )
    return n


def _jitted_draft(cfg: ModelConfig, plan: StepPlan, mesh, page: int, layers: int | None, k: int):
    """(weights, pool, first, step) -> (drafts i32[num_reqs, k], pool); the pool is donated. `first` carries each
    row's tokens the drafter has not seen yet, its newest token last (SELF: that token alone), and its logits give
    the first drafted token; `step` is a one-token-a-request batch (request r at token row r) at the position after
    the newest, moved on by one for each of the k - 1 further drafts. layers: the model's first N (SELF), or all."""
    attend, experts_fn, ops = forward_parts(cfg, plan, mesh)

    def logits_of(weights, pool, batch):
        logits, pool = forward(
            weights, pool, batch, cfg=cfg, attention=attend, ops=ops, experts_fn=experts_fn, first_layers=layers
        )
        if mesh is not None:
            logits = jax.lax.with_sharding_constraint(logits, tp.replicated(mesh))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), pool  # [num_logits]: request r's at r

    def draft(weights, pool, first: StepBatch, step: StepBatch):
        picked, pool = logits_of(weights, pool, first)
        a = step.attn
        num_tokens, num_reqs = step.input_ids.shape[0], a.kv_lens.shape[0]
        rows = jnp.arange(num_tokens)
        real = rows < a.cu_q_lens[-1]
        req = jnp.minimum(rows, num_reqs - 1)
        n = min(num_tokens, picked.shape[0])

        def one(carry, i):
            pool, picked = carry
            ids = jnp.where(real, jnp.zeros(num_tokens, jnp.int32).at[:n].set(picked[:n]), 0)
            pos = jnp.where(real, step.positions + i, 0)
            slots = a.page_table[req, pos // page] * page + pos % page
            moved = StepBatch(
                input_ids=ids,
                positions=pos,
                attn=AttentionMetadata(
                    slot_mapping=jnp.where(real, slots, a.slot_mapping),
                    cu_q_lens=a.cu_q_lens,
                    kv_lens=jnp.where(a.kv_lens > 0, a.kv_lens + i, 0),
                    page_table=a.page_table,
                ),
                logits_idx=step.logits_idx,
            )
            nxt, pool = logits_of(weights, pool, moved)
            return (pool, nxt), nxt

        (pool, _), rest = jax.lax.scan(one, (pool, picked), jnp.arange(k - 1, dtype=jnp.int32))
        drafts = jnp.concatenate([picked[None, : step.logits_idx.shape[0]], rest], axis=0)
        if mesh is not None:
            pool = jax.lax.with_sharding_constraint(pool, tp.pool_sharding(mesh))
        return drafts.T, pool

    return jax.jit(draft, donate_argnums=1)


# one per (model, plan, mesh, page size, layers, k) while a runner holds it (engine/shared.py: compiled programs are
# bounded by the process's memory maps)
DRAFTS = Shared(_jitted_draft, keep=1)


def jitted_draft(cfg: ModelConfig, plan: StepPlan, mesh, page: int, layers: int | None, k: int):
    return DRAFTS(cfg, plan.program(), mesh, page, layers, k)
