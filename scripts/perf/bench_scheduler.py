"""The scheduler's host time per step, without a model: the GPU benchmark's workloads replayed through the real
Scheduler and radix cache, every step's sampled token made up on the host.

    python scripts/perf/bench_scheduler.py --workload-file out/gpu/bench_workload.json   # bench_engine's dump
    python scripts/perf/bench_scheduler.py --num-requests 128   # built here, SmolLM2's tokenizer

On a GPU the device runs a decode step of Llama-3-8B at 128 rows in ~5 ms; whatever the host spends scheduling and
committing a step either hides behind it (the overlap loop) or leaves the device idle. This measures that host
work alone, so it can be tracked on any machine: per step, schedule() and commit() (plus finishing requests), the
share of it in the radix tree and in admission, and the cache hit rate. Rows: one per workload and configuration
(`--match-cache on|off`: admission reuses a waiting request's match until the tree grew under it, or re-matches
every round), with the ratio to the re-matching baseline in the same run. JSON lines go to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from sgjax.engine.request import Req
from sgjax.engine.scheduler import Scheduler, SchedulerConfig


def decode_workload(n: int) -> dict:
    """n requests of 200 random prompt tokens and 300 new ones: steps of n decode rows (the steady state)."""
    rng = np.random.default_rng(0)
    return {"requests": [{"input_ids": rng.integers(0, 30000, 200).tolist(), "max_new_tokens": 300} for _ in range(n)]}


def replay(requests: list[dict], args, match_cache: bool) -> dict:
    settings = dict(
        num_pages=args.max_total_tokens // args.page_size + 1,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        match_cache=match_cache,
    )
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}  # an older tree (before/after runs) lacks some
    cfg = SchedulerConfig(**{k: v for k, v in settings.items() if k in known})
    sched = Scheduler(cfg)
    for i, r in enumerate(requests):
        params = SimpleNamespace(max_new_tokens=r["max_new_tokens"])
        sched.add(Req(rid=str(i), input_ids=list(r["input_ids"]), params=params, seed=0))
    rng = np.random.default_rng(0)
    per_step, rows = [], []
    t_start = time.perf_counter()
    while sched.has_work:
        t0 = time.perf_counter()
        works = sched.schedule()
        for w in works:
            w.target_results = [(0.0, None)] * len(w.target_rows)
        tokens = rng.integers(1000, 30000, len(works))
        for req in sched.commit(works, tokens, np.zeros(len(works)), None):
            if len(req.output_ids) >= req.params.max_new_tokens:
                sched.finish(req)
        per_step.append(time.perf_counter() - t0)
        rows.append(len(works))
    wall = time.perf_counter() - t_start
    st = sched.stats
    full = [s for s, n in zip(per_step, rows) if n >= args.max_running_requests]  # every slot running
    return {
        "steps": len(per_step),
        "wall_s": wall,
        "step_ms_median": 1e3 * statistics.median(per_step),
        "step_ms_mean": 1e3 * wall / len(per_step),
        "step_ms_p90": 1e3 * float(np.percentile(per_step, 90)),
        "full_steps": len(full),
        "full_step_ms_median": 1e3 * statistics.median(full) if full else None,
        "tree_s": st.tree_seconds,
        "admit_s": st.admit_seconds,
        "hit_rate": sched.hit_rate,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload-file", default=None, help="bench_engine.py --dump-workload's JSON")
    ap.add_argument("--workloads", default="sharegpt,mmlu5,decode", help="decode: synthetic, every slot decoding")
    ap.add_argument("--num-requests", type=int, default=128, help="when built here")
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--max-total-tokens", type=int, default=131072)
    ap.add_argument("--chunked-prefill-size", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (the median's row is kept)")
    ap.add_argument("--out", default="/tmp/bench_scheduler.jsonl")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    names = args.workloads.split(",")
    built_here = [n for n in names if n != "decode"]
    if not built_here:
        loaded = {}
    elif args.workload_file:
        with open(args.workload_file) as f:
            loaded = json.load(f)["workloads"]
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_engine import build_workloads

        built = SimpleNamespace(
            model_path=None,
            load_format="auto",
            dummy=None,
            num_requests=args.num_requests,
            max_prompt_len=1024,
            max_output_len=128,
            mmlu_new_tokens=1,
            mmlu_subjects="world_religions,management,high_school_biology,college_computer_science",
            workloads=built_here,
        )
        loaded = build_workloads(built)
    loaded["decode"] = decode_workload(args.max_running_requests)
    results = []
    for name in names:
        requests = loaded[name]["requests"]
        runs = {}
        for _ in range(args.repeat):  # interleaved: both configurations see the same machine state
            for match_cache in (False, True):
                runs.setdefault(match_cache, []).append(replay(requests, args, match_cache))
        base = None
        for match_cache in (False, True):
            rs = sorted(runs[match_cache], key=lambda r: r["wall_s"])
            r = rs[len(rs) // 2]
            base = base or r
            results.append(
                {
                    "workload": name,
                    "configuration": f"match-cache {'on' if match_cache else 'off'}",
                    "requests": len(requests),
                    "max_running_requests": args.max_running_requests,
                    "chunked_prefill_size": args.chunked_prefill_size,
                    **r,
                    "speedup_vs_rematch": base["wall_s"] / r["wall_s"],
                    "cpu": platform.processor() or platform.machine(),
                    "tag": args.tag,
                }
            )
    print(
        f"{'workload':9} {'configuration':15} {'steps':>5} {'wall s':>7} {'ms/step':>7} {'p90':>6} {'full ms':>7} "
        f"{'tree s':>7} {'admit s':>7} {'hit':>5} {'speedup':>7}"
    )
    for r in results:
        full = f"{r['full_step_ms_median']:7.3f}" if r["full_step_ms_median"] is not None else f"{'-':>7}"
        print(
            f"{r['workload']:9} {r['configuration']:15} {r['steps']:5d} {r['wall_s']:7.3f} {r['step_ms_mean']:7.3f} "
            f"{r['step_ms_p90']:6.3f} {full} {r['tree_s']:7.3f} {r['admit_s']:7.3f} {r['hit_rate']:5.3f} "
            f"{r['speedup_vs_rematch']:6.2f}x"
        )
    print("ms/step: schedule + commit (+ finishes) per step, mean; full ms: median over steps with every slot running")
    with open(args.out, "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
