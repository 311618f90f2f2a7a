"""The engine loop's step time while other Python threads of the same process are busy (GIL contention).

The engine runs as a thread beside the caller's threads (frontend programs, the HTTP server). Each step releases
the GIL at its device calls and must take it back from whichever thread is running, waiting up to Python's switch
interval. This measures a tiny random model (so the step is mostly host work) decoding 16 requests, with 0 or N
threads spinning in pure Python, at several switch intervals; the baseline is Python's default (5 ms) in the same
run. The engine sets the interval from `gil_switch_interval_ms` at start; here it is set before each row.

    python scripts/perf/bench_gil.py [--busy 4] [--intervals-ms 5,2,1,0.5,0.2] [--out /tmp/bench_gil.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

from sgjax.engine.engine import Engine
from sgjax.model.config import ModelConfig
from sgjax.model.weights import dummy_weights

CFG = ModelConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


def _spin(stop: threading.Event):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def run_row(engine, prompts, params, busy: int) -> tuple[float, int]:
    stop = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for t in threads:
        t.start()
    steps0 = engine.get_server_info()["steps"]
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    return seconds, engine.get_server_info()["steps"] - steps0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=4, help="busy Python threads beside the engine")
    ap.add_argument("--intervals-ms", default="5,2,1,0.5,0.2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default="/tmp/bench_gil.jsonl")
    args = ap.parse_args()
    engine = Engine.from_weights(
        CFG, dummy_weights(CFG), max_running_requests=args.requests, max_total_tokens=16384, gil_switch_interval_ms=None
    )
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, 500, 40)] for _ in range(args.requests)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate(input_ids=prompts, sampling_params=params)  # compiles the shapes
    rows, base = [], {}
    intervals = [float(x) for x in args.intervals_ms.split(",")]
    for ms in [5.0] + [x for x in intervals if x != 5.0]:
        sys.setswitchinterval(ms / 1e3)
        for busy in (0, args.busy):
            run_row(engine, prompts, params, busy)  # one untimed pass: the first after a change is noisy
            seconds, steps = run_row(engine, prompts, params, busy)
            tokens = args.requests * args.new_tokens
            if ms == 5.0:
                base[busy] = seconds
            rows.append(
                dict(
                    workload=f"tiny-decode-{args.requests}x{args.new_tokens}",
                    configuration=f"switch {ms:g} ms, {busy} busy threads",
                    switch_interval_ms=ms,
                    busy_threads=busy,
                    platform=sys.platform,
                    tokens_per_s=tokens / seconds,
                    ms_per_step=1e3 * seconds / steps,
                    steps=steps,
                    cache_hit_rate=None,
                    speedup_vs_default=base[busy] / seconds,
                )
            )
            r = rows[-1]
            print(
                f"{r['configuration']:34s} {r['ms_per_step']:8.2f} ms/step {r['tokens_per_s']:9.0f} tok/s "
                f"x{r['speedup_vs_default']:.2f} vs 5 ms",
                flush=True,
            )
    engine.shutdown()
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
