"""Where a batch's time goes, by step kind: the Engine on the default SmolLM2 runs --batch ShareGPT prompts of
--prompt-tokens tokens with --new-tokens greedy tokens each (the batch workload of bench_cpu_peers.py), twice, and
the second run's step timeline (sgjax/engine/steplog.py) is summed per kind: prefill, mixed (prefill chunks beside
decode rows) and decode steps, with their tokens.

    python scripts/probes/probe_batch_steps.py                      # CPU: 16 x 200 tokens, 64 new
    python scripts/probes/probe_batch_steps.py --engine-args '{"chunked_prefill_size": 256}'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "perf"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engine-args", default="{}", help="JSON of Engine keyword arguments")
    args = ap.parse_args()
    from bench_cpu_peers import prompts

    from sgjax.engine.engine import Engine
    from sgjax.engine.steplog import summarize

    with Engine(None, **json.loads(args.engine_args)) as eng:
        ps = prompts(eng.tokenizer, args.batch, args.prompt_tokens)
        params = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
        for _ in range(2):  # the first compiles
            eng.flush_cache()
            eng.step_log = []
            t0 = time.perf_counter()
            eng.generate(input_ids=ps, sampling_params=params)
            wall = time.perf_counter() - t0
        log = eng.step_log
    print(f"wall {wall:.2f} s, {args.batch * args.new_tokens / wall:.1f} output tok/s, {len(log)} steps")
    kinds = collections.defaultdict(lambda: [0, 0.0, 0])
    prev_ready = 0.0
    for s in log:  # device time: from max(dispatch, previous ready) to ready (steplog's convention)
        k = kinds[s.kind]
        k[0] += 1
        k[1] += (s.ready - max(s.dispatched, prev_ready)) if s.ready else 0.0
        k[2] += s.tokens
        prev_ready = s.ready or prev_ready
    for kind, (n, busy, tokens) in kinds.items():
        print(f"  {kind:8s} {n:4d} steps {busy:7.2f} s {tokens:6d} tokens")
    print("  idle share", round(summarize(log).get("idle_share", 0.0), 4))


if __name__ == "__main__":
    main()
