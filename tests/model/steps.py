"""Model-level test helpers: the forward as a jitted step over a host batch or a packed buffer, and a small greedy
generator over the paged pool (sequential pages, no cache, no scheduler) for parity with HF transformers."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.buckets import bucket
from sgjax.kernels import allocate_pool, default_backend, get_backend
from sgjax.model.batch import BatchShape, build_batch, pack, unpack
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward
from sgjax.model.weights import Weights, unstack_layers


def make_step(cfg: ModelConfig, attention):
    """The jitted step: (weights, pool, batch) -> (logits, pool), with the pool donated."""
    return jax.jit(functools.partial(forward, cfg=cfg, attention=attention), donate_argnames=("pool",))


def make_packed_step(cfg: ModelConfig, attention):
    """The jitted step over a packed batch: (weights, pool, buffer, shape) -> (logits, pool).

    `buffer` is `batch.pack(host_batch)` (one int32 transfer per step) and `shape` its static BatchShape.
    """

    def step(weights, pool, buffer, shape: BatchShape):
        return forward(weights, pool, unpack(buffer, shape), cfg=cfg, attention=attention)

    return jax.jit(step, donate_argnames=("pool",), static_argnames=("shape",))


@dataclass
class GenerateResult:
    output_ids: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int


class GreedyGenerator:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        *,
        page_size: int = 16,
        max_context: int = 2048,
        max_batch: int = 16,
        attention: str | None = None,
    ):
        self.cfg, self.page_size = cfg, page_size
        self.weights = weights if jax.devices()[0].platform == "cpu" else unstack_layers(weights)
        self.pages_per_req = -(-max_context // page_size)
        self.max_batch = max_batch
        self.num_pages = 1 + max_batch * self.pages_per_req  # + the null page
        self.step = make_packed_step(cfg, get_backend(attention or default_backend(jax.devices()[0].platform)))
        self.pool = allocate_pool(
            cfg.num_layers, self.num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=jnp.dtype(cfg.dtype)
        )

    def _run(self, chunks, kv_lens, tables):
        num_reqs = bucket(len(chunks), 4)
        # The page-table width is bucketed too: attention work follows the longest live context, not the
        # generator's maximum (the ref backend reads every page-table entry).
        width = min(bucket(-(-max(kv_lens) // self.page_size), 4), self.pages_per_req)
        batch = build_batch(
            chunks,
            kv_lens,
            [t[:width] for t in tables],
            self.page_size,
            bucket(sum(map(len, chunks)), 16),
            num_reqs,
            width,
        )
        logits, self.pool = self.step(self.weights, self.pool, jnp.asarray(pack(batch)), BatchShape.of(batch))
        return np.asarray(jnp.argmax(logits[: len(chunks)], axis=-1))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> GenerateResult:
        if len(prompts) > self.max_batch:
            raise ValueError(f"{len(prompts)} prompts exceed max_batch={self.max_batch}")
        limit = self.pages_per_req * self.page_size
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if len(p) + max_new_tokens > limit:
                raise ValueError(f"prompt of {len(p)} tokens + {max_new_tokens} new tokens exceeds the context {limit}")
        tables = [
            list(range(1 + i * self.pages_per_req, 1 + (i + 1) * self.pages_per_req)) for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        nxt = self._run([list(p) for p in prompts], [len(p) for p in prompts], tables)
        prefill = time.perf_counter() - t0
        outs = [[int(t)] for t in nxt]
        done = [int(t) in stop_ids or max_new_tokens <= 1 for t in nxt]
        steps = 0
        t0 = time.perf_counter()
        while not all(done):
            live = [i for i, d in enumerate(done) if not d]
            nxt = self._run(
                [[outs[i][-1]] for i in live], [len(prompts[i]) + len(outs[i]) for i in live], [tables[i] for i in live]
            )
            steps += 1
            for i, t in zip(live, nxt):
                outs[i].append(int(t))
                done[i] = int(t) in stop_ids or len(outs[i]) >= max_new_tokens
        return GenerateResult(outs, prefill, time.perf_counter() - t0, steps)
