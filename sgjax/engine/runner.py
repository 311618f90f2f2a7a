"""The model runner: turns the scheduler's works into one padded ragged batch and runs the jitted step.

One step = forward + sampler in a single jitted program, fed by a single int32 buffer (the batch metadata and the
per-row sampling parameters, floats bit-cast) and returning only the sampled tokens and logprobs, so a step costs
one host->device and one device->host transfer and never syncs inside. The KV pool is donated.

Shapes come from buckets (powers of two): tokens T, requests R, logits rows L, page-table width P (the `ref`
backend reads every page-table entry, so P follows the longest live context; the Pallas kernels read only
`kv_lens` pages, so P is fixed there), penalty history W (0 unless a request uses penalties) and top-logprobs K.
Everything else is an array, so a steady workload compiles nothing new.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.sampler import default_rows, pack_sampling, sample, sampling_size, unpack_sampling
from sgjax.engine.scheduler import Work
from sgjax.fsm.device import unpack_bits
from sgjax.kernels import allocate_pool, get_backend
from sgjax.model.batch import BatchShape, build_batch, pack, unpack
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward
from sgjax.model.weights import Weights, for_platform


def bucket(n: int, minimum: int, factor: int = 2) -> int:
    b = minimum
    while b < n:
        b *= factor
    return b


@dataclass(frozen=True)
class StepShape:
    batch: BatchShape
    history: int  # W
    top_logprobs: int  # K
    mask_words: int = 0  # ceil(V / 32) when a row is constrained (packed allowed-token bits per row), else 0


@functools.lru_cache(maxsize=None)
def jitted_step(cfg: ModelConfig, attention: str):
    """The jitted (weights, pool, buffer, shape) -> (SampleOutput, pool); one per (model, backend) per process, so
    every engine in a process shares its compiled executables. `traces` counts compilations (tests)."""
    attend = get_backend(attention)

    def step(weights, pool, buffer, shape: StepShape):
        step.traces += 1
        n = sum(shape.batch.sizes)
        num_rows = shape.batch.num_logits
        m = n + sampling_size(num_rows, shape.history)
        batch = unpack(buffer[:n], shape.batch)
        rows = unpack_sampling(buffer[n:m], num_rows, shape.history)
        logits, pool = forward(weights, pool, batch, cfg=cfg, attention=attend)
        mask = None
        if shape.mask_words:
            mask = unpack_bits(buffer[m:].reshape(num_rows, shape.mask_words), cfg.vocab_size)
        return sample(logits, rows, num_top_logprobs=shape.top_logprobs, mask=mask), pool

    step.traces = 0
    fn = jax.jit(step, donate_argnames=("pool",), static_argnames=("shape",))
    fn.counter = step
    return fn


class Runner:
    def __init__(self, cfg: ModelConfig, weights: Weights, *, num_pages: int, page_size: int, max_context: int,
                 attention: str, max_top_logprobs: int = 20):
        self.cfg, self.page_size, self.attention = cfg, page_size, attention
        self.platform = jax.devices()[0].platform
        self.weights = for_platform(weights, self.platform)
        self.max_pages = -(-max_context // page_size)
        self.max_top_logprobs = max_top_logprobs
        self.num_pages = num_pages
        self.reset_pool()
        self.step = jitted_step(cfg, attention)
        self.shapes_seen: set[StepShape] = set()

    def reset_pool(self) -> None:
        cfg = self.cfg
        self.pool = allocate_pool(cfg.num_layers, self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim,
                                  dtype=jnp.dtype(cfg.dtype))

    def pool_lost(self) -> bool:
        return self.pool is None or self.pool.is_deleted()

    @property
    def traces(self) -> int:
        return self.step.counter.traces

    def _width(self, pages: int) -> int:
        if self.attention == "pallas":
            return self.max_pages
        return min(bucket(pages, 16), self.max_pages)

    def run(self, works: list[Work]):
        """Run one step. Returns (tokens, logprobs, top) per work and fills each work's prompt_results."""
        buffer, shape, sample_rows, prompt_rows = self.prepare(works)
        out, self.pool = self.step(self.weights, self.pool, jnp.asarray(buffer), shape)
        self.shapes_seen.add(shape)
        tokens, logprobs, top_ids, top_lps = jax.device_get((out.tokens, out.logprobs, out.top_ids, out.top_logprobs))
        return self._unpack_results(works, sample_rows, prompt_rows, tokens, logprobs, top_ids, top_lps)

    def prepare(self, works: list[Work]):
        """Host side of a step: the packed buffer, its static shape, and where each work's rows are."""
        chunks = [w.tokens for w in works]
        kv_lens = [w.start + len(w.tokens) for w in works]
        tables = [w.req.pages for w in works]
        sample_rows, prompt_rows, logits_rows = [], [], []
        t = 0
        for w in works:
            prompt_rows.append([len(logits_rows) + j for j in range(len(w.prompt_rows))])
            logits_rows += [t + r for r, _ in w.prompt_rows]
            sample_rows.append(len(logits_rows) if w.sample else -1)
            if w.sample:
                logits_rows.append(t + len(w.tokens) - 1)
            t += len(w.tokens)
        num_reqs = bucket(len(works), 4)
        num_logits = bucket(max(len(logits_rows), 1), num_reqs)
        width = self._width(max(len(p) for p in tables))
        batch = build_batch(chunks, kv_lens, [p[:width] for p in tables], self.page_size, bucket(t, 16), num_reqs,
                            width, logits_rows=logits_rows, num_logits=num_logits)
        rows, history, top_k = self._sampling_rows(works, num_logits, sample_rows, prompt_rows)
        masks = self._masks(works, num_logits, sample_rows)
        shape = StepShape(BatchShape.of(batch), history, top_k, 0 if masks is None else masks.shape[1])
        parts = [pack(batch), pack_sampling(rows)] + ([] if masks is None else [masks.reshape(-1)])
        return np.concatenate(parts), shape, sample_rows, prompt_rows

    def _masks(self, works, num_logits, sample_rows):
        """Packed allowed-token bits per logits row (all ones for unconstrained rows), or None when no row is
        constrained. The FSM state lives on the host, which needs every token anyway (stops, jump-forward), so
        the mask row is copied from the grammar's table: ceil(V/32) words per row, in the step's one buffer."""
        constrained = [(w, r) for w, r in zip(works, sample_rows) if r >= 0 and w.req.grammar is not None]
        if not constrained:
            return None
        words = -(-self.cfg.vocab_size // 32)
        masks = np.full((num_logits, words), -1, np.int32)
        for w, row in constrained:
            bits = w.req.grammar.mask_bits[w.req.fsm_state]
            masks[row, :len(bits)] = bits
            masks[row, len(bits):] = 0  # model ids past the tokenizer's vocabulary are never allowed
        return masks

    def _sampling_rows(self, works, num_logits, sample_rows, prompt_rows):
        vocab = self.cfg.vocab_size
        penalised = [w for w in works if w.sample and _uses_penalties(w.req.params)]
        histories = {id(w): _history(w.req, vocab) for w in penalised}
        # A coarse ladder: the history length varies with every prompt, and each width is a compilation.
        width = bucket(max(map(len, histories.values())), 64, factor=4) if histories else 0
        top = max((w.req.top_logprobs_num for w in works if w.req.return_logprob), default=0)
        top = bucket(min(top, self.max_top_logprobs), 1) if top else 0
        rows = default_rows(num_logits, width)
        needs_filter = False
        for w, srow, prows in zip(works, sample_rows, prompt_rows):
            for row, (_, target) in zip(prows, w.prompt_rows):
                rows["target"][row] = target
            if srow < 0:
                continue
            p, req = w.req.params, w.req
            rows["seed"][srow] = req.seed
            rows["step"][srow] = len(req.output_ids)
            if not p.is_greedy:
                rows["temperature"][srow] = p.temperature
                rows["top_k"][srow] = max(p.top_k, 0)
                rows["top_p"][srow] = p.top_p
                rows["min_p"][srow] = p.min_p
                needs_filter |= p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
            rows["frequency_penalty"][srow] = p.frequency_penalty
            rows["presence_penalty"][srow] = p.presence_penalty
            rows["repetition_penalty"][srow] = p.repetition_penalty
            h = histories.get(id(w))
            if h is not None:
                rows["history"][srow, :len(h)] = h
        rows["needs_filter"] = np.asarray(int(needs_filter), np.int32)
        return rows, width, top

    def _unpack_results(self, works, sample_rows, prompt_rows, tokens, logprobs, top_ids, top_lps):
        k = top_ids.shape[1]

        def tops(row, req):
            if not (req.return_logprob and req.top_logprobs_num and k):
                return None
            n = min(req.top_logprobs_num, k)
            return [(float(top_lps[row, j]), int(top_ids[row, j])) for j in range(n)]

        out_tokens, out_lps, out_top = [], [], []
        for w, srow, prows in zip(works, sample_rows, prompt_rows):
            w.prompt_results = [(float(logprobs[r]), tops(r, w.req)) for r in prows]
            out_tokens.append(int(tokens[srow]) if srow >= 0 else -1)
            out_lps.append(float(logprobs[srow]) if srow >= 0 else 0.0)
            out_top.append(tops(srow, w.req) if srow >= 0 else None)
        return out_tokens, out_lps, out_top

    def precompile(self, shapes: list[tuple[int, int, int]]) -> None:
        """Compile (tokens, requests, page width) buckets ahead of traffic with a dummy batch on the null page."""
        for num_tokens, num_reqs, width in shapes:
            batch = build_batch([[0]], [1], [[0]], self.page_size, num_tokens, num_reqs, width)
            rows = default_rows(num_reqs, 0)
            rows["needs_filter"] = np.asarray(0, np.int32)
            shape = StepShape(BatchShape.of(batch), 0, 0)
            out, self.pool = self.step(self.weights, self.pool, jnp.asarray(np.concatenate([pack(batch),
                                                                                       pack_sampling(rows)])), shape)
            jax.block_until_ready(out.tokens)
            self.shapes_seen.add(shape)


def _uses_penalties(p) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def _history(req, vocab: int) -> np.ndarray:
    """The sampler's penalty window: generated ids, then the prompt's distinct ids + vocab (repetition only)."""
    out = np.asarray(req.output_ids, np.int32)
    if req.params.repetition_penalty == 1.0:
        return out
    prompt = np.unique(np.asarray(req.input_ids, np.int32)) + vocab
    return np.concatenate([out, prompt])
