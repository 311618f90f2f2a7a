"""XLA's ragged_dot against the Pallas grouped matmul (kernels/grouped_matmul_gpu.py) for one MoE layer's experts
(model/moe.experts: gate and up, the activation, down), on the device, per shape and tokens per step.

Routing is uniform at random (k distinct experts per token), weights random bf16. Prints ms per call and the
roofline: the routed experts' weight bytes plus the rows' activations over the copy bandwidth, or the FLOPs over the
bf16 matmul rate, both measured in the same run; writes JSON lines. `--sweep` also times the block configs in
SWEEP for the Pallas kernel (the default config is default_config's).

    python scripts/probes/probe_moe_gmm.py --out $OUT/probe_moe_gmm.jsonl [--sweep]
    python scripts/probes/probe_moe_gmm.py --shapes small --tokens 4,40   # CPU: interpret mode, a smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # name: (experts, k, D, F)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
    "small": (8, 2, 64, 128),
}
SWEEP = [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s)
         for m, n, k, w, s in [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 128, 64, 4, 4), (16, 256, 64, 4, 3),
                               (32, 128, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4),
                               (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]]


def routing(tokens: int, experts: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32)
    return jnp.asarray(w / w.sum(-1, keepdims=True), jnp.bfloat16), jnp.asarray(ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral-8x7b,qwen3-30b-a3b,olmoe-1b-7b")
    ap.add_argument("--tokens", default="1,8,32,128,512,4096", help="tokens per step")
    ap.add_argument("--sweep", action="store_true", help="also time the block configs in SWEEP")
    ap.add_argument("--out", default="/tmp/probe_moe_gmm.jsonl")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "perf"))
    from roofline import copy_bandwidth, matmul_rate, time_fn

    from sgjax.kernels import grouped_matmul_gpu as gmm
    from sgjax.model import moe

    small = jax.devices()[0].platform == "cpu"
    bw = copy_bandwidth(1 << 24 if small else 4 << 30)
    rate = matmul_rate(256 if small else 8192)
    out = []
    for name in args.shapes.split(","):
        e, k, d, f = SHAPES[name]
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        w_gate, w_up = (jax.random.normal(kk, (e, d, f), jnp.bfloat16) * d ** -0.5 for kk in keys[:2])
        w_down = jax.random.normal(keys[2], (e, f, d), jnp.bfloat16) * f ** -0.5
        for tokens in map(int, args.tokens.split(",")):
            h = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, d), jnp.bfloat16)
            top_w, top_i = routing(tokens, e, k, tokens)
            distinct = len(np.unique(np.asarray(top_i)))
            nbytes = 3 * distinct * d * f * 2 + 2 * tokens * k * (2 * d + 2 * f) + 2 * tokens * d * 2
            flops = 2 * 3 * tokens * k * d * f
            roof_s = max(nbytes / bw, flops / rate)
            variants = [("ragged_dot", None), ("pallas", None)]
            if args.sweep:
                variants += [("pallas", c) for c in SWEEP]
            ref = None
            for label, config in variants:
                if config and not (gmm.supported(d, f, config) and gmm.supported(f, d, config)):
                    continue
                fn = functools.partial(moe.experts, kernel="xla" if label == "ragged_dot" else "pallas",
                                       kernel_config=config)
                call = jax.jit(fn)
                try:
                    y = np.asarray(call(h, top_w, top_i, w_gate, w_up, w_down), np.float32)
                except Exception as exc:  # a config the Triton compiler rejects (shared memory): reported, skipped
                    print(f"{name} {tokens} {label} {config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                ref = y if ref is None else ref
                err = float(np.linalg.norm(y - ref) / (np.linalg.norm(ref) + 1e-30))
                s = time_fn(call, h, top_w, top_i, w_gate, w_up, w_down, warmup=2, iters=10 if tokens > 512 else 20)
                row = {"probe": "moe_gmm", "shape": name, "experts": e, "k": k, "d": d, "f": f, "tokens": tokens,
                       "distinct_experts": distinct, "variant": label,
                       "config": config or ("default" if label == "pallas" else None), "ms": s * 1e3,
                       "roofline_ms": roof_s * 1e3, "roofline_ratio": roof_s / s, "gb_per_s": nbytes / s / 1e9,
                       "tflop_per_s": flops / s / 1e12, "rel_err_vs_ragged_dot": err,
                       "device": jax.devices()[0].device_kind, "copy_gb_per_s": bw / 1e9,
                       "bf16_tflop_per_s": rate / 1e12, "jax": jax.__version__}
                out.append(row)
                print(f"{name:14s} T {tokens:5d} ({distinct:3d} experts) {label:10s} {str(config or ''):70s} "
                      f"{s * 1e3:8.3f} ms roof {roof_s * 1e3:7.3f} ({100 * roof_s / s:5.1f}%) err {err:.1e}",
                      flush=True)
        del w_gate, w_up, w_down
    with open(args.out, "a") as fh:
        for r in out:
            fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
