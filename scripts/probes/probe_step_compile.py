"""Probe: what one step shape costs to compile, and what the coarse ladder's padding costs to run.

    python scripts/probes/probe_step_compile.py --model smollm2 --out out/probe.jsonl           # H200
    python scripts/probes/probe_step_compile.py --model tiny --tokens 16,64 --out /tmp/p.jsonl  # CPU smoke run

For each token bucket T and each coarse variant (L = R or T, mask words 0 or the vocabulary) it times the first
call of the jitted step (trace + compile, or a load from JAX's persistent cache when JAX_COMPILATION_CACHE_DIR holds
it) and the median of later calls. With --compare-fine it also times the fine ladder's shape for the same batch
(R, L and K fitted to it), which is what the coarse ladder's padding is measured against. Dummy weights, one
request on the null page: the step's work depends on its shape, not on the values. One JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from sgjax.engine.runner import Runner, StepShape  # noqa: E402
from sgjax.model.batch import BatchShape  # noqa: E402
from sgjax.model.config import ModelConfig, llama3_8b_config  # noqa: E402
from sgjax.model.weights import dummy_weights  # noqa: E402


def model_config(name: str, dtype: str) -> ModelConfig:
    if name == "llama3-8b":
        return llama3_8b_config(dtype)
    if name == "smollm2":  # SmolLM2-135M's shapes
        return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True, dtype=dtype)
    return ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048, dtype=dtype)


def timed(runner: Runner, shape: StepShape, iters: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    jax.block_until_ready(runner.run_dummy(shape))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.run_dummy(shape))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times) if times else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2", "llama3-8b"], default="smollm2")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, float32 on CPU")
    ap.add_argument("--attention", default=None, help="ref | pallas (default by platform)")
    ap.add_argument("--tokens", default="16,128,1024", help="token buckets T to probe")
    ap.add_argument("--variants", default="base,mask,logits_t", help="base (L=R), mask, logits_t (L=T)")
    ap.add_argument("--max-reqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--compare-fine", default="", help="request counts n: the fine shape of n decode rows, "
                                                        "timed beside the coarse one")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from sgjax.kernels import default_backend

    platform = jax.devices()[0].platform
    dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
    cfg = model_config(args.model, dtype)
    attention = args.attention or default_backend(platform)
    t0 = time.perf_counter()
    weights = dummy_weights(cfg)
    runner = Runner(cfg, weights, num_pages=1 + 4096 // 16, page_size=16, max_context=args.context,
                    attention=attention, coarse=True, max_reqs=args.max_reqs)
    fine = Runner.__new__(Runner)
    fine.__dict__.update(runner.__dict__)
    fine.buckets = type(runner.buckets)(coarse=False, max_reqs=args.max_reqs,
                                        max_top_logprobs=runner.buckets.max_top_logprobs)
    print(f"{platform} {cfg.num_layers} layers {dtype} {attention}; weights in {time.perf_counter() - t0:.1f} s",
          flush=True)
    b = runner.buckets
    words = -(-cfg.vocab_size // 32)
    width = runner._width(runner.max_pages)
    rows = []

    def record(name, shape, **extra):
        compile_s, step_s = timed(runner, shape, args.iters)
        row = {"probe": "step_compile", "tag": args.tag, "platform": platform, "model": args.model, "dtype": dtype,
               "attention": attention, "variant": name, "tokens": shape.batch.num_tokens,
               "reqs": shape.batch.num_reqs, "logits": shape.batch.num_logits, "top": shape.top_logprobs,
               "mask_words": shape.mask_words, "first_call_s": compile_s, "step_ms": step_s * 1e3,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), **extra}
        rows.append(row)
        print(f"{name:10} T={row['tokens']:5} R={row['reqs']:4} L={row['logits']:5} K={row['top']:3} "
              f"mask={row['mask_words']:5}  first call {compile_s:7.2f} s  step {row['step_ms']:8.3f} ms", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    for t in [int(x) for x in args.tokens.split(",")]:
        r = b.reqs(t, 1)
        for v in args.variants.split(","):
            logits = t if v == "logits_t" else r
            record(v, StepShape(BatchShape(t, r, width, logits), 0, 0, words if v == "mask" else 0,
                                        branches=b.branches(False)))
    for n in [int(x) for x in args.compare_fine.split(",") if x]:
        t = -(-n // 16) * 16
        t = 1 << (t - 1).bit_length()
        fr = fine.buckets.reqs(t, n)
        record("fine", StepShape(BatchShape(t, fr, width, fine.buckets.logits(n, fr, t)), 0, 0, 0), decode_rows=n)
        cr = b.reqs(t, n)
        record("coarse", StepShape(BatchShape(t, cr, width, b.logits(n, cr, t)), 0, 0, 0, branches=b.branches(False)),
               decode_rows=n)


if __name__ == "__main__":
    main()
