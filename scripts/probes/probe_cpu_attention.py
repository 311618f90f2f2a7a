"""Which `ref` attention strategy is cheapest on a CPU for the engine's step shapes? Times one layer's attention
(SmolLM2's heads: 9 query / 3 KV heads of 64, pages of 16) per strategy for decode, single-stream decode, mixed and
prefill shapes of the fine ladder (T rows, R requests, P pages per request), the K/V write left out (the engine
donates the pool, so it is in place). Prints one line per shape and writes JSON lines (--out); kernels/ref.py's
choose_strategy follows these numbers (docs/engine.md, "CPU attention")."""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.kernels import ref
from sgjax.kernels.metadata import AttentionMetadata

HQ, HKV, D, PAGE = 9, 3, 64, 16
# (T, R, real requests, tokens of context each, P): decode of 16, one stream, 16 decoding beside a chunk, prefills
SHAPES = [(16, 16, 16, 264, 32), (16, 4, 1, 264, 32), (64, 16, 16, 264, 32), (512, 4, 1, 200, 32), (256, 1, 1, 200, 16)]


def case(t, r, real, ctx, p, rng):
    pages = 2048
    pool = jnp.asarray(rng.standard_normal((2, pages, PAGE, 2 * HKV, D)).astype(np.float32))
    rows = [t // real] * real if real > 1 else [min(t, ctx)]
    cu = np.zeros(r + 1, np.int32)
    cu[1:real + 1] = np.cumsum(rows)
    cu[real + 1:] = cu[real]
    lens = np.zeros(r, np.int32)
    lens[:real] = ctx
    table = np.zeros((r, p), np.int32)
    table[:real] = np.stack([rng.permutation(np.arange(1, pages))[:p] for _ in range(real)])
    meta = AttentionMetadata(slot_mapping=jnp.zeros(t, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             kv_lens=jnp.asarray(lens), page_table=jnp.asarray(table))
    q = jnp.asarray(rng.standard_normal((t, HQ, D)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((t, HKV, D)).astype(np.float32))
    return q, k, k, pool, meta, int(cu[real])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="/tmp/probe_cpu_attention.jsonl")
    args = ap.parse_args()
    ref.write_kv = lambda pool, layer, k, v, slots: pool  # the attention alone
    rng = np.random.default_rng(0)
    for t, r, real, ctx, p in SHAPES:
        q, k, v, pool, meta, total = case(t, r, real, ctx, p, rng)
        row = {"device": jax.devices()[0].device_kind, "T": t, "R": r, "real_requests": real, "context": ctx, "P": p,
               "auto": ref.choose_strategy(r, HQ, HKV, D, t)}
        outs = {}
        for strategy in ("segment", "gather", "blocked", "paged"):
            attend = functools.partial(ref.ref_attention, sm_scale=D ** -0.5, strategy=strategy)
            # the output alone: returning the (undonated) pool would copy it every call
            fn = jax.jit(lambda q, k, v, pool, meta, attend=attend: attend(q, k, v, pool, 0, meta)[0])
            outs[strategy] = np.asarray(fn(q, k, v, pool, meta))
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                out = fn(q, k, v, pool, meta)
            out.block_until_ready()
            row[f"{strategy}_ms"] = 1e3 * (time.perf_counter() - t0) / args.repeats
        row["max_diff"] = float(max(np.abs(outs[s][:total] - outs["gather"][:total]).max() for s in outs))
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
