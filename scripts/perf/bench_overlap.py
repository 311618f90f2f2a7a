"""The overlap loop against one step at a time: decode throughput of one batch, same requests, same engine settings.

    python scripts/perf/bench_overlap.py                        # a tiny random model on this machine (host-bound steps)
    python scripts/perf/bench_overlap.py --model-path PATH      # a real checkpoint (SmolLM2 by default with --smollm2)
    python scripts/perf/bench_overlap.py --model-path DIR --load-format dummy   # random weights for DIR's config
    python scripts/perf/bench_overlap.py --dummy llama3-8b      # random Llama-3-8B weights (bf16), no tokenizer

Prints a table and appends JSON lines (--out): configuration, wall seconds (median of --repeats), output tokens per
second, steps, overlapped steps, and the ratio to one step at a time measured in the same run. On a CPU the device
is the host's own cores, so overlap shows less here than on a GPU, where the host work hides behind the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from sgjax.engine.steplog import summarize


def make_engine(args, overlap: bool):
    from sgjax.engine.engine import Engine

    common = dict(
        max_running_requests=args.batch,
        max_total_tokens=args.max_total_tokens or args.batch * (args.prompt + args.new + 32),
        disable_overlap_schedule=not overlap,
    )
    if args.chunked_prefill_size:
        common["chunked_prefill_size"] = args.chunked_prefill_size
    if args.attention_backend:
        common["attention_backend"] = args.attention_backend
    if args.dtype:
        common["dtype"] = args.dtype
    if args.model_path or args.smollm2:
        return Engine(args.model_path, load_format=args.load_format, **common)
    from sgjax.model.config import llama3_8b_config
    from sgjax.model.presets import TINY_LLAMA
    from sgjax.model.weights import dummy_weights

    if args.dummy:
        if args.dummy != "llama3-8b":
            raise SystemExit(f"unknown --dummy {args.dummy!r}; known: llama3-8b")
        if not hasattr(args, "weights"):  # both engines share one set of 16 GB of random weights
            args.cfg = llama3_8b_config("bfloat16")
            args.weights = dummy_weights(args.cfg)
        return Engine.from_weights(args.cfg, args.weights, None, **common)
    return Engine.from_weights(TINY_LLAMA, dummy_weights(TINY_LLAMA), **common)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--smollm2", action="store_true", help="the embedded SmolLM2 (the engine's default model)")
    ap.add_argument(
        "--load-format",
        default="auto",
        help="dummy: random weights for --model-path's config (e.g. the "
        "Llama-3-8B directory: a config.json of its shapes)",
    )
    ap.add_argument("--dummy", default=None, help="llama3-8b: random Llama-3-8B weights (bf16), no tokenizer")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV pool (default: what the batch needs)")
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="the engine's default otherwise; smaller means fewer step shapes to compile at start",
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="ref | pallas | pallas:triton | pallas:mgpu (the 8B's ladder compiles faster with triton)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        help="a checkpoint's dtype (the engine's default: bfloat16 on "
        "accelerators); the issue's SmolLM2 rows are float32",
    )
    ap.add_argument("--out", default="bench_overlap.jsonl")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, args.prompt).tolist() for _ in range(args.batch)]
    params = {"max_new_tokens": args.new, "temperature": 0, "ignore_eos": True}
    rows = []
    for overlap in (False, True):
        with make_engine(args, overlap) as eng:
            eng.generate(input_ids=prompts, sampling_params=params)  # compiles the shapes
            eng.flush_cache()
            times, outs = [], None
            for _ in range(args.repeats):
                before = eng.get_server_info()
                eng.step_log = []
                t0 = time.perf_counter()
                outs = eng.generate(input_ids=prompts, sampling_params=params)
                times.append(time.perf_counter() - t0)
                after = eng.get_server_info()
                eng.flush_cache()
            wall = statistics.median(times)
            rows.append(
                dict(
                    workload=f"decode {args.batch} x {args.new} after {args.prompt}-token prompts",
                    config="overlap" if overlap else "one_step_at_a_time",
                    wall_s=wall,
                    wall_s_runs=times,
                    output_tok_per_s=args.batch * args.new / wall,
                    steps=after["steps"] - before["steps"],
                    overlapped_steps=after["overlapped_steps"] - before["overlapped_steps"],
                    timeline=summarize(eng.step_log),
                    model=args.model_path or args.dummy or ("smollm2" if args.smollm2 else "tiny-random"),
                    dtype=args.dtype or "default",
                    outputs_hash=hash(tuple(tuple(o["output_ids"]) for o in outs)),
                )
            )
    base = rows[0]["wall_s"]
    for r in rows:
        r["speedup_vs_one_step_at_a_time"] = base / r["wall_s"]
    if rows[0]["outputs_hash"] != rows[1]["outputs_hash"]:
        raise SystemExit("overlap changed the outputs")
    print(
        f"{'config':22s} {'wall s':>8s} {'tok/s':>9s} {'steps':>6s} {'overlapped':>10s} {'vs sync':>8s} "
        f"{'idle%':>6s} {'decode ms':>9s}"
    )
    for r in rows:
        t = r["timeline"]
        print(
            f"{r['config']:22s} {r['wall_s']:8.3f} {r['output_tok_per_s']:9.1f} {r['steps']:6d} "
            f"{r['overlapped_steps']:10d} {r['speedup_vs_one_step_at_a_time']:8.2f} "
            f"{100 * t.get('idle_share', 0):6.2f} "
            f"{1e3 * t.get('decode_busy_s', 0) / max(t.get('decode_steps', 0), 1):9.2f}"
        )
    print(
        "idle%: device idle between steps / the steps' span of the last repeat (sgjax/engine/steplog.py); decode "
        "ms: device time per decode step"
    )
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
