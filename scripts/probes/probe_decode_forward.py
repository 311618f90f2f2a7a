"""The jitted 30-layer forward of the default SmolLM2 (fp32) on one decode step of --rows rows, each at a context
that fills --pages pages of 16 but the last 20 slots (264 tokens at most), per `ref` attention strategy: what the
attention strategy costs inside the scanned layer loop, where the one-layer probe (probe_cpu_attention.py) cannot
see the loop's own costs. Prints the median and best of --repeats calls per strategy (the pool donated).
--weight-dtype runs each strategy once per matrices' dtype (config.weight_dtype: bf16 matrices under float32
activations), with the logits' largest difference from the first's.

    python scripts/probes/probe_decode_forward.py --pages 32 --strategies gather paged
    python scripts/probes/probe_decode_forward.py --strategies paged --weight-dtype float32 bfloat16
"""

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.args import ServerArgs
from sgjax.engine.loading import default_dtype, load_model_cached
from sgjax.kernels import allocate_pool, ref
from sgjax.kernels.metadata import AttentionMetadata
from sgjax.model import llama
from sgjax.model.batch import StepBatch
from sgjax.model.weights import unstack_layers, with_weight_dtype

PAGE = 16


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--pages", type=int, default=32, help="pages per request of the step's bucket")
    ap.add_argument("--strategies", nargs="+", default=["gather", "paged"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--weight-dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--layers", nargs="+", default=["scan"], choices=["scan", "unrolled", "calls"],
                    help="the layer loop: scanned stacked weights, unrolled, or calls: L host calls of one jitted "
                         "layer (model/weights.layer_loop_for; the engine's loop for bf16 matrices on a CPU)")
    args = ap.parse_args()
    base_cfg, base_weights = load_model_cached(None, default_dtype(ServerArgs()))
    cfg = base_cfg
    b, p = args.rows, args.pages
    ctx = min(264, p * PAGE - 20)
    pool = allocate_pool(cfg.num_layers, b * p + 1, PAGE, cfg.num_kv_heads, cfg.head_dim)
    table = (1 + np.arange(b * p).reshape(b, p)).astype(np.int32)  # contiguous, as a fresh pool hands them out
    slots = table[:, (ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE
    batch = StepBatch(input_ids=jnp.asarray(np.arange(b, dtype=np.int32) * 37),
                      logits_idx=jnp.arange(b, dtype=jnp.int32), positions=jnp.full((b,), ctx - 1, jnp.int32),
                      attn=AttentionMetadata(slot_mapping=jnp.asarray(slots.astype(np.int32)),
                                             cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32),
                                             kv_lens=jnp.full((b,), ctx, jnp.int32), page_table=jnp.asarray(table)))
    first = None
    for strategy, weight_dtype, layers in [(s, d, lp) for s in args.strategies for d in args.weight_dtype
                                           for lp in args.layers]:
        cfg, weights = with_weight_dtype(base_cfg, base_weights, weight_dtype)
        weights = unstack_layers(weights) if layers != "scan" else weights
        attention = functools.partial(ref.ref_attention, strategy=strategy)
        if layers == "calls":
            step = _layer_calls(cfg, attention)
        else:
            step = jax.jit(lambda w, pool, batch, attention=attention, cfg=cfg: llama.forward(
                w, pool, batch, cfg=cfg, attention=attention), donate_argnums=1)
        t0 = time.perf_counter()
        logits, pool = step(weights, pool, batch)
        compile_s = time.perf_counter() - t0
        first = np.asarray(logits) if first is None else first
        diff = float(np.abs(np.asarray(logits) - first).max())
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            logits, pool = step(weights, pool, batch)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"{strategy:8s} {weight_dtype:8s} {layers:8s} (first call {compile_s:.1f} s) rows {b} pages {p} context {ctx}: median "
              f"{1e3 * times[len(times) // 2]:.1f} ms, best {1e3 * times[0]:.1f} ms, max |logits - first's| "
              f"{diff:.3g}", flush=True)


def _layer_calls(cfg, attention):
    """The forward as the engine runs bf16 matrices on a CPU: embeddings, model/llama.LayerCalls (one jitted block
    called per layer, the pool donated), the final norm and LM head."""
    calls = llama.LayerCalls(cfg, attention)
    embed = jax.jit(lambda table, batch: llama.embed_rows(table, batch, cfg))
    head = jax.jit(lambda top, x, batch: llama.head(top, x, batch, cfg))

    def step(weights, pool, batch):
        x, pool, _ = calls(weights.layers, embed(weights.embed, batch), pool, batch)
        return head(dataclasses.replace(weights, layers=()), x, batch), pool

    return step


if __name__ == "__main__":
    main()
