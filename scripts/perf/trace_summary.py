"""Where device time goes in a JAX profiler trace: busy time, idle gaps and the top ops, from the trace.json.gz that
`jax.profiler.stop_trace` writes (no TensorBoard needed).

    python scripts/perf/trace_summary.py DIR          # DIR: the log_dir given to jax.profiler.start_trace

Device lines are the trace's processes named /device:GPU:N (or TPU); on a CPU run there are none, and the summary
falls back to the XLA CPU client's threads. Busy time is the union of the op intervals (streams overlap), idle the
rest of the span between the first and the last op; the engine's host annotations (sgjax.schedule, sgjax.dispatch,
sgjax.collect, sgjax.commit) are totalled beside them.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys

HOST_MARKS = ("sgjax.schedule", "sgjax.dispatch", "sgjax.collect", "sgjax.commit")


def load_events(log_dir: str) -> tuple[list[dict], dict, dict]:
    files = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [e for e in events if e.get("ph") == "X"], procs, threads


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize_trace(log_dir: str, top: int = 15) -> dict:
    events, procs, threads = load_events(log_dir)
    device_pids = {p for p, name in procs.items() if name.startswith("/device:")}
    if device_pids:
        ops = [e for e in events if e["pid"] in device_pids]
        source = sorted(procs[p] for p in device_pids)
    else:  # CPU: XLA runs the program on its client threads
        ops = [e for e in events if "XLA" in threads.get((e["pid"], e["tid"]), "")]
        source = ["host XLA threads"]
    out: dict = {"source": source, "ops": len(ops)}
    if ops:
        spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in ops]
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        busy = _union(spans)
        by_name = collections.Counter()
        for e in ops:
            by_name[e["name"]] += e.get("dur", 0.0)
        out.update(
            span_ms=(end - start) / 1e3,
            busy_ms=busy / 1e3,
            idle_share=1 - busy / (end - start) if end > start else 0.0,
            top_ops=[
                {"name": n[:120], "ms": d / 1e3, "share_of_busy": d / busy if busy else 0.0}
                for n, d in by_name.most_common(top)
            ],
        )
    marks = collections.Counter()
    for e in events:
        if e["name"] in HOST_MARKS:
            marks[e["name"]] += e.get("dur", 0.0)
    out["host_ms"] = {k: v / 1e3 for k, v in marks.items()}
    return out


def main() -> None:
    summary = summarize_trace(sys.argv[1])
    print(json.dumps({k: v for k, v in summary.items() if k != "top_ops"}, indent=1))
    for op in summary.get("top_ops", []):
        print(f"{op['ms']:10.3f} ms {100 * op['share_of_busy']:5.1f}%  {op['name']}")


if __name__ == "__main__":
    main()
