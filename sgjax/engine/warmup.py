"""The runner's start: which step shapes a fresh engine compiles ahead of traffic (`start_shapes`), compiling them
(in threads off the CPU) and running each once on a dummy buffer that writes only the null page (`warm`). A mixin
of engine/runner.Runner, whose step, weights, state and buckets it reads."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine import mesh as tp
from sgjax.engine.sampler import default_rows
from sgjax.engine.step import StepShape
from sgjax.engine.step import pack as pack_step
from sgjax.model.batch import BatchShape, build_batch


class Warmup:
    def start_shapes(self, max_tokens: int) -> list[StepShape]:
        """The shapes worth compiling at start, at the widest page table. Coarse: for every T up to max_tokens (a
        step's most tokens) the shapes without penalties, top logprobs or filters (L = R or T, with and without a
        mask), and L = R with the filters. The rest (K > 0, filters with a mask or L = T) compile at first use:
        the top-K and the filters' sort cost too much to carry in every step (docs/journal/bench-h200.md).
        Fine: the decode buckets (one token per request: 1, 4, 8, ... requests) up to the most requests."""
        shapes = self._start_shapes(max_tokens)
        return shapes if self.adapters is None else [dataclasses.replace(s, lora=1) for s in shapes]

    def _start_shapes(self, max_tokens: int) -> list[StepShape]:
        width = self._width(self.max_pages)
        b = self.buckets
        if not b.coarse:
            out, r = [], 1
            while True:
                t = b.tokens(r)
                reqs = b.reqs(t, r)
                out.append(StepShape(BatchShape(t, reqs, width, b.logits(r, reqs, t)), 0, 0))
                if r >= b.max_reqs:
                    return out
                r = 4 if r == 1 else 2 * r
        words = -(-self.cfg.vocab_size // 32)
        out = []
        for t in b.tokens_ladder(max_tokens):
            r = b.reqs(t, 1)
            for logits in sorted({r, t}):
                out += [
                    StepShape(BatchShape(t, r, width, logits), 0, 0, mask, branches=b.branches(False))
                    for mask in (0, words)
                ]
            # top-k / top-p / min-p sampling without a grammar, the common chat request, is ready at start too
            out.append(StepShape(BatchShape(t, r, width, r), 0, 0, 0, branches=b.branches(True)))
        return out

    def precompile(self, shapes: list[StepShape], threads: int = 1) -> None:
        """Compile step shapes ahead of traffic, `threads` at a time (XLA compiles outside the GIL: on a GPU host,
        where a shape takes seconds, most of each compile overlaps with the others'). Lowering with the live arrays
        fills jit's own cache,
        so traffic of these shapes neither traces nor compiles again."""
        todo = [s for s in shapes if s not in self.shapes_seen]

        def compile_one(shape):
            buffer = jax.ShapeDtypeStruct(
                (shape.size,), jnp.int32, sharding=None if self.mesh is None else tp.replicated(self.mesh)
            )
            self.step.lower(self.weights, self.state, buffer, shape, **self._extra).compile()
            return shape

        if threads <= 1:
            done = map(compile_one, todo)
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads, thread_name_prefix="sgjax-compile") as ex:
                done = list(ex.map(compile_one, todo))
        self.shapes_seen.update(done)

    def _dummy_buffer(self, shape: StepShape) -> np.ndarray:
        """A step buffer of `shape`: one one-token request on the null page, every row unconstrained."""
        b = shape.batch
        batch = build_batch(
            [[0]], [1], [[0]], self.page_size, b.num_tokens, b.num_reqs, b.pages_per_req, num_logits=b.num_logits
        )
        rows = default_rows(b.num_logits, shape.history)
        rows["needs_filter"] = np.asarray(0, np.int32)
        mask = np.full((b.num_logits, shape.mask_words), -1, np.int32) if shape.mask_words else None
        which = np.full(b.num_tokens, -1, np.int32) if shape.image_rows else None
        slots = np.full(b.num_tokens, -1, np.int32) if shape.lora else None
        return pack_step(shape, batch, rows, which, mask, slots)

    def precompile_start(self, max_tokens: int, warm: bool = True) -> str:
        """The engine's start: the step shapes most traffic takes (start_shapes; a step holds at most max_tokens),
        compiled (in parallel threads off the CPU) and, with `warm`, run once. Returns the log line."""
        t0 = time.perf_counter()
        shapes = self.start_shapes(max_tokens)
        threads = 1 if self.platform == "cpu" else max(1, min(len(shapes), (os.cpu_count() or 2) // 2))
        self.precompile(shapes, threads)
        done = f"precompiled {len(shapes)} step shapes in {time.perf_counter() - t0:.1f} s ({threads} threads)"
        if not warm:
            return done
        t1 = time.perf_counter()
        self.warm(shapes)
        return f"{done}, ran each once in {time.perf_counter() - t1:.1f} s"

    def warm(self, shapes: list[StepShape]) -> None:
        """Run each shape once on the dummy buffer (it writes only the null page). A GPU loads an executable's
        kernels at its first run, not at compile time, so without this the first batches of a fresh process pay
        for it inside their timing (docs/journal/engine-h200.md)."""
        out = None
        for shape in shapes:
            out = self.run_dummy(shape)
        if out is not None:
            jax.block_until_ready(out)
        if self.state.expert_tokens is not None:  # the dummy rows routed too: not traffic (the GPU warms, the CPU not)
            self._expert_base = np.asarray(jax.device_get(tp.local_value(self.state.expert_tokens)))

    def run_dummy(self, shape: StepShape):
        """One step of `shape` on the dummy buffer (compiles it the first time); returns the sampled tokens."""
        return self.execute(self._dummy_buffer(shape), shape).tokens
