"""The step program: one jitted (weights, state, buffer, shape) -> (sampled rows, state) per model, step plan and
mesh (`jitted_step`). `compiles(step)` counts the executables a step got."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading

import jax
import jax.numpy as jnp

from sgjax.engine import mesh as tp
from sgjax.engine.plan import StepPlan
from sgjax.engine.sampler import sample
from sgjax.engine.sentinels import future_history, future_input, resolve_future
from sgjax.engine.shared import Shared
from sgjax.engine.step import DeviceState, StepShape, unpack
from sgjax.fsm.device import unpack_bits
from sgjax.kernels import get_backend
from sgjax.model import kv_scales
from sgjax.model.config import ModelConfig
from sgjax.model.llama import XLA, XLA_W8A8, embed_lookup, forward

# Held while a step compiles a new shape (engine/runner.py): one compile and persistent-cache write at a time in a
# process, whatever its engines.
COMPILE_LOCK = threading.RLock()

# Executables the jitted steps got (compiled, or loaded from the persistent cache), by the step's function name:
# jax reports every backend compile through jax.monitoring with the function's name.
_COMPILES: collections.Counter = collections.Counter()
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _on_event(event: str, duration: float, **kwargs) -> None:
    name = str(kwargs.get("fun_name", ""))
    if name.startswith("jit(") and name.endswith(")"):  # jax names a jitted function's program jit(<name>)
        name = name[4:-1]
    if event == _BACKEND_COMPILE and name in _COMPILES:
        _COMPILES[name] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _step_inputs(future, buffer, shape: StepShape):
    """Inside a step: the batch, sampling rows, image rows, mask words and LoRA slots from the buffer, the overlap
    loop's placeholders resolved from `future`."""
    batch, rows, image_rows, mask_words, lora_slots = unpack(buffer, shape)
    batch = dataclasses.replace(batch, input_ids=resolve_future(batch.input_ids, future, future_input(0)))
    if shape.history:
        rows = dataclasses.replace(rows, history=resolve_future(rows.history, future, future_history(0)))
    return batch, rows, image_rows, mask_words, lora_slots


def _image_embeds(embed, batch, image_rows, image_features, shape: StepShape, cfg: ModelConfig):
    """The rows' embeddings with image tokens taking their feature rows (None for a step without images)."""
    if not shape.image_rows:
        return None
    embeds = embed_lookup(embed, batch.input_ids).astype(jnp.dtype(cfg.dtype))
    picked = image_features[jnp.clip(image_rows, 0, shape.image_rows - 1)].astype(embeds.dtype)
    return jnp.where((image_rows >= 0)[:, None], picked, embeds)


def _step_outputs(logits, rows, mask_words, future, shape: StepShape, cfg: ModelConfig):
    """Inside a step: the sampled rows, and `future` with each running request's new token at its slot."""
    mask = None if mask_words is None else unpack_bits(mask_words, cfg.vocab_size)
    with jax.named_scope("sampler"):
        out = sample(logits, rows, num_top_logprobs=shape.top_logprobs, mask=mask, branches=shape.branches)
    slots = future.shape[0]
    return out, future.at[jnp.where(rows.slot >= 0, rows.slot, slots)].set(out.tokens, mode="drop")


def ops_for(plan: StepPlan):
    """The forward's Ops for the plan (model/native.py's where the CPU multiplies natively)."""
    if plan.matmul == "native":
        from sgjax.model.native import NATIVE

        return NATIVE
    return XLA_W8A8 if plan.fp8_activations else XLA


def forward_parts(cfg: ModelConfig, plan: StepPlan, mesh: jax.sharding.Mesh | None = None):
    """(attention, experts, ops) a jitted forward of this plan runs with: with a mesh, attention under shard_map
    over the heads (a Pallas kernel cannot be split by GSPMD) and the experts as the mesh places them."""
    attend = get_backend(plan.attention)
    if mesh is not None:
        attend = tp.sharded_attention(attend, mesh)
    if plan.kv_scales is not None:  # an fp8 pool's scales, around the backend (model/kv_scales.py)
        attend = kv_scales.scaled(attend, plan.kv_scales)
    return attend, tp.experts_for(cfg, mesh, plan.moe_kernel, plan.expert_parallel), ops_for(plan)


def jitted_step(cfg: ModelConfig, plan: StepPlan, mesh: jax.sharding.Mesh | None = None, renew: bool = False):
    """The shared step; `renew`: a new one, whose programs compile again (the old one's go with its last holder)."""
    if renew:
        STEPS.forget((cfg, plan.program(), mesh))
    return STEPS(cfg, plan.program(), mesh)


def step_name(cfg: ModelConfig, plan: StepPlan, mesh: jax.sharding.Mesh | None = None) -> str:
    """The step's function name, from its key alone: the persistent compilation cache's keys hash a program's module
    name (jit_<name>), so a name that counted the steps made before it in the process made the same program a
    miss in every other process (a test worker, or a server, that had made other steps first) and in a step made
    again (renewed near the memory-map limit, or after its last engine was gone). Steps of one key share the name
    and their compile count (`compiles`), as engines holding one step do."""
    where = None if mesh is None else (mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat])
    digest = hashlib.sha256(repr((cfg, plan.program(), where)).encode()).hexdigest()[:16]
    return f"sgjax_step_{digest}"


def _jitted_step(cfg: ModelConfig, plan: StepPlan, mesh: jax.sharding.Mesh | None = None):
    """The jitted (weights, state, buffer, shape, image_features, lora) -> (SampleOutput, state); one per (model, plan,
    mesh) while an engine holds it (STEPS, engine/shared.py), so a process's engines share its compiled
    executables. The DeviceState (pool and future tokens) is donated. `compiles(fn)` counts the executables it
    got (tests, benchmarks).

    With a mesh (tensor parallelism, engine/mesh.py) attention runs under shard_map over the heads, the logits are
    gathered to every device before the sampler (which runs replicated), and the state keeps its sharding."""
    attend, experts_fn, ops = forward_parts(cfg, plan, mesh)
    name = step_name(cfg, plan, mesh)  # its compile events' fun_name
    _COMPILES.setdefault(name, 0)

    def step(weights, state: DeviceState, buffer, shape: StepShape, image_features=None, lora=None):
        future = state.future
        batch, rows, image_rows, mask_words, lora_slots = _step_inputs(future, buffer, shape)
        embeds = _image_embeds(weights.embed, batch, image_rows, image_features, shape, cfg)
        logits, pool, stats = forward(
            weights,
            state.pool,
            batch,
            cfg=cfg,
            attention=attend,
            ops=ops,
            input_embeds=embeds,
            experts_fn=experts_fn,
            with_stats=True,
            lora=None if lora is None else (lora, lora_slots),  # model/lora.LoraStacks, the engine's adapters
        )
        expert_tokens = None if stats is None else state.expert_tokens + stats
        if mesh is not None:  # full-vocabulary logits for the sampler (a gather when the lm_head is vocab-sharded)
            logits = jax.lax.with_sharding_constraint(logits, tp.replicated(mesh))
        out, future = _step_outputs(logits, rows, mask_words, future, shape, cfg)
        if mesh is not None:  # the donated state comes back as it went in, so the next step neither moves nor compiles
            pool = jax.lax.with_sharding_constraint(pool, tp.pool_sharding(mesh))
            future = jax.lax.with_sharding_constraint(future, tp.replicated(mesh))
            if expert_tokens is not None:
                expert_tokens = jax.lax.with_sharding_constraint(expert_tokens, tp.replicated(mesh))
        return out, DeviceState(pool=pool, future=future, expert_tokens=expert_tokens)

    step.__name__ = step.__qualname__ = name
    fn = jax.jit(step, donate_argnames=("state",), static_argnames=("shape",))
    fn.step_name = name
    return fn


STEPS = Shared(_jitted_step, keep=1)


def compiles(fn) -> int:
    """Executables a jitted step (or the step of that name) got so far."""
    return _COMPILES[fn if isinstance(fn, str) else fn.step_name]
