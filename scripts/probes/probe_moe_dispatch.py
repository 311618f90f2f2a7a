"""Which grouped matmul for a mixture of experts' few-token steps? One expert matmul (x [n, D] @ W[e_n] [D, F] for
n routed (token, expert) rows over E experts) three ways, on the device:

  ragged_dot   jax.lax.ragged_dot over the rows sorted by expert (what model/moe.py does)
  gather       W[ids] gathered to [n, D, F], then one batched einsum
  slices       a Python loop over the rows: lax.dynamic_index_in_dim(W, e) @ x (n static, small)

Prints ms per call and the bytes-of-the-routed-experts roofline (distinct experts x D x F x itemsize / the copy
bandwidth) and writes JSON lines. The H200 measured ragged_dot reading every expert at batch 1
(docs/architecture.md, "Mixtures of experts").

    python scripts/probes/probe_moe_dispatch.py --out $OUT/probe_moe_dispatch.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (experts, D, F)
    "mixtral-8x7b": (8, 4096, 14336),
    "qwen3-30b-a3b": (128, 2048, 768),
    "small": (8, 64, 128),
}


def variants():
    def ragged(x, ids, w):
        order = jnp.argsort(ids, stable=True)
        sizes = jnp.bincount(ids, length=w.shape[0]).astype(jnp.int32)
        y = jax.lax.ragged_dot(x[order], w, sizes, preferred_element_type=jnp.float32)
        return jnp.zeros_like(y).at[order].set(y)

    def gather(x, ids, w):
        return jnp.einsum("nd,ndf->nf", x, w[ids], preferred_element_type=jnp.float32)

    def slices(x, ids, w):
        rows = [jnp.dot(x[i], jax.lax.dynamic_index_in_dim(w, ids[i], keepdims=False),
                        preferred_element_type=jnp.float32) for i in range(x.shape[0])]
        return jnp.stack(rows)

    return {"ragged_dot": ragged, "gather": gather, "slices": slices}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--rows", default="2,8,16,64", help="routed (token, expert) rows per call")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="/tmp/probe_moe_dispatch.jsonl")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
    from roofline import copy_bandwidth

    small = jax.devices()[0].platform == "cpu"
    bw = copy_bandwidth(1 << 24 if small else 4 << 30)
    dtype = jnp.float32 if small else jnp.bfloat16
    rows_out = []
    for name in args.shapes.split(","):
        e, d, f = SHAPES[name]
        w = jax.random.normal(jax.random.PRNGKey(0), (e, d, f), dtype)
        for n in map(int, args.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(1), (n, d), dtype)
            ids = jnp.asarray(np.random.default_rng(n).integers(0, e, n), jnp.int32)
            distinct = len(set(np.asarray(ids).tolist()))
            roof_ms = 1e3 * distinct * d * f * jnp.dtype(dtype).itemsize / bw
            ref = None
            for label, fn in variants().items():
                call = jax.jit(fn)
                out = np.asarray(call(x, ids, w), np.float32)
                ref = out if ref is None else ref
                err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-9))
                jax.block_until_ready(call(x, ids, w))
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    y = call(x, ids, w)
                jax.block_until_ready(y)
                ms = 1e3 * (time.perf_counter() - t0) / args.iters
                rows_out.append({"probe": "moe_dispatch", "shape": name, "experts": e, "d": d, "f": f, "rows": n,
                                 "distinct_experts": distinct, "variant": label, "ms": ms, "roofline_ms": roof_ms,
                                 "roofline_ratio": roof_ms / ms, "rel_err_vs_ragged_dot": err,
                                 "device": jax.devices()[0].device_kind, "copy_gb_per_s": bw / 1e9})
                print(f"{name:14s} rows {n:3d} ({distinct:3d} experts) {label:10s} {ms:8.3f} ms "
                      f"roof {roof_ms:7.3f} ms ({100 * roof_ms / ms:5.1f}%) err {err:.1e}", flush=True)
    with open(args.out, "a") as fh:
        for r in rows_out:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
