"""What a trainer runs on the params an engine serves (engine/training.py takes back what it learns): the
log-probability of each token of whole sequences, one jitted full-sequence forward, differentiable in the params.

The model's own forward (model/llama.py) on a scratch pool with every row's logits: the `ref` attention (each
sequence against its own keys, no loop) and XLA's dots on the params as loaded (stacked layers), the arithmetic a
trainer differentiates. The engine's logprobs for the same sequence equal these to float32 rounding
(tests/engine/test_training.py): what an RL loop's importance ratios assume.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.kernels import allocate_pool
from sgjax.kernels.ref import ref_attention
from sgjax.model.batch import build_batch
from sgjax.model.config import ModelConfig
from sgjax.model.llama import forward
from sgjax.model.weights import Weights


def sequence_logprobs(weights: Weights, cfg: ModelConfig, tokens, page_size: int = 16):
    """log p(tokens[b, t] | tokens[b, :t]) for t >= 1: f32[B, T - 1]. `tokens`: ints [B, T] on the host (sequences
    of one length); `weights`: the params in the loaded layout, cfg.dtype."""
    tokens = np.asarray(tokens, np.int32)
    rows, length = tokens.shape
    pages = -(-length // page_size)
    tables = [list(range(1 + r * pages, 1 + (r + 1) * pages)) for r in range(rows)]
    total = rows * length
    batch = build_batch(
        [list(t) for t in tokens],
        [length] * rows,
        tables,
        page_size,
        total,
        rows,
        pages,
        logits_rows=list(range(total)),
        num_logits=total,
    )
    return _logprobs(weights, batch, jnp.asarray(tokens), cfg=cfg, num_pages=1 + rows * pages, page_size=page_size)


@functools.partial(jax.jit, static_argnames=("cfg", "num_pages", "page_size"))
def _logprobs(weights, batch, tokens, *, cfg: ModelConfig, num_pages: int, page_size: int):
    pool = allocate_pool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    # every row attends within its own sequence, all of which is in this step: the `segment` strategy, no loop
    logits, _ = forward(weights, pool, batch, cfg=cfg, attention=functools.partial(ref_attention, strategy="segment"))
    rows, length = tokens.shape
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(rows, length, -1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
