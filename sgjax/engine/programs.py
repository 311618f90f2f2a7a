"""The step programs: one jitted (weights, state, buffer, shape) -> (sampled rows, state) per model, backend and
mesh (`jitted_step`), or, for bf16 or int8 matrices on a CPU, the same step as three jitted parts and a host call
per layer (`CallsStep`; model/weights.layer_loop_for), with decode's few-row steps as one program again where the
native matmul runs them (`FewRowsStep`). `compiles(step)` counts the executables a step got."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp

from sgjax.engine import mesh as tp
from sgjax.engine.sampler import sample
from sgjax.engine.sentinels import future_history, future_input, resolve_future
from sgjax.engine.step import DeviceState, StepShape, unpack
from sgjax.fsm.device import unpack_bits
from sgjax.kernels import get_backend
from sgjax.model.config import ModelConfig
from sgjax.model.llama import (EVERY_ROW, LayerCalls, embed_lookup, embed_rows, forward, head, matmul_precision,
                               native_rows)

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
    """Inside a step: the batch, sampling rows, image rows and mask words from the buffer, the overlap loop's
    placeholders resolved from `future`."""
    batch, rows, image_rows, mask_words = unpack(buffer, shape)
    batch = dataclasses.replace(batch, input_ids=resolve_future(batch.input_ids, future, future_input(0)))
    if shape.history:
        rows = dataclasses.replace(rows, history=resolve_future(rows.history, future, future_history(0)))
    return batch, rows, image_rows, mask_words


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


@functools.lru_cache(maxsize=None)
def jitted_step(cfg: ModelConfig, attention: str, mesh: jax.sharding.Mesh | None = None, moe_kernel: str = "xla",
                calls: bool = False):
    """The jitted (weights, state, buffer, shape, image_features) -> (SampleOutput, state); one per (model,
    backend, mesh) per process, so every engine in a process shares its compiled executables. The DeviceState (pool
    and future tokens) is donated. `compiles(fn)` counts the executables it got (tests, benchmarks).

    With a mesh (tensor parallelism, engine/mesh.py) attention runs under shard_map over the heads, the logits are
    gathered to every device before the sampler (which runs replicated), and the state keeps its sharding.
    `calls`: the same step as a CallsStep (the layers as host calls; model/weights.layer_loop_for)."""
    attend = get_backend(attention)
    if mesh is not None:
        attend = tp.sharded_attention(attend, mesh)
    experts_fn = tp.experts_for(cfg, mesh, moe_kernel)
    name = f"sgjax_step_{len(_COMPILES)}"  # its compile events' fun_name
    _COMPILES[name] = 0
    if calls and native_rows(cfg) == 0:
        return CallsStep(cfg, attend, experts_fn, name)

    def step(weights, state: DeviceState, buffer, shape: StepShape, image_features=None):
        future = state.future
        batch, rows, image_rows, mask_words = _step_inputs(future, buffer, shape)
        embeds = _image_embeds(weights.embed, batch, image_rows, image_features, shape, cfg)
        logits, pool, stats = forward(weights, state.pool, batch, cfg=cfg, attention=attend, input_embeds=embeds,
                                      experts_fn=experts_fn, with_stats=True)
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
    fn.precompile = lambda weights, state, buffer, shape: fn.lower(weights, state, buffer, shape).compile()
    if calls and native_rows(cfg) < EVERY_ROW:
        return FewRowsStep(fn, CallsStep(cfg, attend, experts_fn, name), native_rows(cfg))
    return fn


class FewRowsStep:
    """Under config.matmul "cpu": a step of at most llama.native_rows rows (decode) as one program, whose
    products are native kernel calls (no layer calls' overhead, and no XLA dot to compile per layer); a larger one
    (prefill) as a CallsStep, whose XLA dots use the CPU's matrix units."""

    def __init__(self, one, calls: CallsStep, rows: int):
        self.one, self.calls, self.rows, self.step_name = one, calls, rows, calls.step_name

    def part(self, shape: StepShape):
        return self.one if shape.batch.num_tokens <= self.rows else self.calls

    def __call__(self, weights, state: DeviceState, buffer, shape: StepShape, *image_features):
        # image_features only when given: the jitted part's cache keys on its arguments as passed (precompile's)
        return self.part(shape)(weights, state, buffer, shape, *image_features)

    def precompile(self, weights, state: DeviceState, buffer, shape: StepShape) -> None:
        self.part(shape).precompile(weights, state, buffer, shape)


class CallsStep:
    """The step of jitted_step as three jitted parts and host calls between them, for one device: the head (the
    buffer unpacked, placeholders resolved, embeddings), the layers (model/llama.LayerCalls), the tail (final norm,
    LM head, sampler, future tokens, expert counts). The same inputs, outputs and donation as the one program."""

    def __init__(self, cfg: ModelConfig, attend, experts_fn, name: str):
        self.cfg, self.step_name = cfg, name
        self.layers = LayerCalls(cfg, attend, experts_fn, name=f"{name}_layer")

        def first(embed, future, buffer, image_features, *, shape):
            batch, _, image_rows, _ = _step_inputs(future, buffer, shape)
            embeds = _image_embeds(embed, batch, image_rows, image_features, shape, cfg)
            return embed_rows(embed, batch, cfg, embeds), batch

        def last(top, x, future, expert_tokens, stats, buffer, *, shape):
            with matmul_precision(cfg.dtype):
                batch, rows, _, mask_words = _step_inputs(future, buffer, shape)
                out, future = _step_outputs(head(top, x, batch, cfg), rows, mask_words, future, shape, cfg)
            return out, future, (None if stats is None else expert_tokens + stats)

        first.__name__ = first.__qualname__ = f"{name}_first"
        last.__name__ = last.__qualname__ = name  # one executable per step shape: what compiles(step) counts
        self.first = jax.jit(first, static_argnames=("shape",))
        self.last = jax.jit(last, static_argnames=("shape",), donate_argnames=("future", "expert_tokens"))

    def __call__(self, weights, state: DeviceState, buffer, shape: StepShape, image_features=None):
        x, batch = self.first(weights.embed, state.future, buffer, image_features, shape=shape)
        x, pool, stats = self.layers(weights.layers, x, state.pool, batch)
        top = dataclasses.replace(weights, layers=())
        out, future, expert_tokens = self.last(top, x, state.future, state.expert_tokens, stats, buffer, shape=shape)
        return out, DeviceState(pool=pool, future=future, expert_tokens=expert_tokens)

    def precompile(self, weights, state: DeviceState, buffer, shape: StepShape) -> None:
        """Compile the three parts for `shape` (abstract buffer), as jit's lower().compile() does the one program."""
        first = self.first.lower(weights.embed, state.future, buffer, None, shape=shape)
        first.compile()
        x, batch = jax.eval_shape(lambda *a: self.first(*a, shape=shape), weights.embed, state.future, buffer, None)
        for lowered in self.layers.lower_all(weights.layers, x, state.pool, batch):
            lowered.compile()
        stats = (jax.ShapeDtypeStruct((self.cfg.num_layers, self.cfg.num_experts), jnp.int32)
                 if self.cfg.is_moe else None)
        top = dataclasses.replace(weights, layers=())
        self.last.lower(top, x, state.future, state.expert_tokens, stats, buffer, shape=shape).compile()


def compiles(fn) -> int:
    return _COMPILES[fn.step_name]
