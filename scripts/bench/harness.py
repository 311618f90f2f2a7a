"""The shared harness: run a workload under each configuration on a fresh engine, measure and report.

Per (workload, configuration) one JSON line: programs/s over the whole batch (run_batch with many threads),
mean latency of one program at a time, accuracy where there are labels, the achieved cache hit rate (cached /
prompt tokens counted by the engine) and the Theorem 3.1 optimum over every prompt the engine was given in that
run (Engine.request_log, whole pages, cold cache), and ratios to the full system and to the baseline measured
in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from sgjax.cache.optimal import optimal_prompt_tokens_with_outputs


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    engine: dict = dataclasses.field(default_factory=dict)  # ServerArgs overrides
    parallel: bool = True  # frontend parallelism: many programs at once, forks in parallel
    hint: bool = True  # the fork prefix hint (a prefill-only request before the branches)
    # programs run one call at a time take as long as all their calls in a row: a few suffice for the ratio
    max_programs: int | None = None


# The paper's Figure 8c ablations.
CONFIGS = {
    "full": Config("full"),
    "no_cache": Config("no_cache", engine={"disable_radix_cache": True}),
    "no_tree": Config("no_tree", engine={"cache": "table"}),
    "fcfs": Config("fcfs", engine={"schedule_policy": "fcfs"}),
    "random": Config("random", engine={"schedule_policy": "random"}),
    "no_frontend_parallelism": Config("no_frontend_parallelism", parallel=False, max_programs=8),
    "no_frontend_hint": Config("no_frontend_hint", hint=False),
}
# Not the paper's, run only when named in --configs: the engine waits for each step's tokens (no overlap loop).
EXTRA_CONFIGS = {"no_overlap": Config("no_overlap", engine={"disable_overlap_schedule": True})}


def measure(workload, runner, threads: int, latency_programs: int, repeats: int = 1) -> dict:
    """Time the batch and one-at-a-time runs of `workload` on `runner` (a frontend over one engine or a baseline).

    runner: .run_batch(program, arguments, threads) -> states; .reset() (flush the cache, start a request
    log); .counters() -> {prompt_tokens, cached_tokens} or None; .requests() -> [(prompt ids, output ids)].
    With repeats > 1 the batch runs that many times from a cold cache and the median time counts: a GPU batch
    takes a fraction of a second, where one run's noise (threads starting, a first tokenization) is large. The
    counters come from the last run."""
    args = workload.arguments
    times, first = [], None
    for _ in range(max(1, repeats)):
        runner.reset()
        before = runner.counters()
        first = first or before
        t0 = time.perf_counter()
        states = runner.run_batch(workload.program, args, threads)
        times.append(time.perf_counter() - t0)
        after = runner.counters()
    requests = runner.requests()
    batch_s = statistics.median(times)
    row = {"programs": len(args), "batch_s": batch_s, "programs_per_s": len(args) / batch_s}
    if len(times) > 1:
        row["batch_s_runs"] = times
    if before is not None:
        # steps compiled inside the timed run: a nonzero count means compile time is in the numbers
        row["compiles"] = after.get("traces", 0) - first.get("traces", 0)  # over every timed run
        prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
        cached = after["cached_tokens"] - before["cached_tokens"]
        row.update(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
            optimal_hit_rate=optimal_hit_rate(requests, runner.page_size),
            engine_requests=len(requests),
        )
        if row["optimal_hit_rate"]:
            row["hit_over_optimal"] = row["hit_rate"] / row["optimal_hit_rate"]
    row["accuracy"] = workload.score(states, workload.labels) if workload.score else None
    latencies = []
    if latency_programs:
        runner.reset()
        for a in args[:latency_programs]:
            t0 = time.perf_counter()
            runner.run_batch(workload.program, [a], 1)
            latencies.append(time.perf_counter() - t0)
        row["latency_s"] = statistics.mean(latencies)
        row["latency_programs"] = len(latencies)
    row["outputs"] = [_answer(s) for s in states]
    return row


def optimal_hit_rate(requests: list[tuple[list[int], list[int]]], page_size: int) -> float | None:
    """Theorem 3.1's best hit rate for the requests the engine saw, counting decoded tokens that later prompts
    send back as free (sgjax.cache.optimal.optimal_prompt_tokens_with_outputs)."""
    total = sum(len(p) for p, _ in requests)
    if not total:
        return None
    computed = optimal_prompt_tokens_with_outputs([p for p, _ in requests], [o for _, o in requests], page_size)
    return 1.0 - computed / total


def _answer(state) -> str:
    """What each program produced, kept so runs can be compared program by program (baseline agreement)."""
    try:
        text = state.text()
    except Exception as e:  # a failed program is recorded, not fatal to the benchmark
        return f"<error: {e}>"
    return text[-200:]


def add_ratios(rows: list[dict], baseline: str) -> None:
    """Throughput and latency relative to `full` and to the baseline of the same workload in the same run."""
    by = {(r["workload"], r["config"]): r for r in rows}
    for r in rows:
        for ref_name, key in (("full", "vs_full"), (baseline, "vs_baseline")):
            ref = by.get((r["workload"], ref_name))
            if ref:
                r[f"throughput_{key}"] = r["programs_per_s"] / ref["programs_per_s"]
                if r.get("latency_s") and ref.get("latency_s"):
                    r[f"latency_{key}"] = r["latency_s"] / ref["latency_s"]


def agreement(rows: list[dict], baseline: str) -> None:
    """Share of programs whose output equals the baseline's (greedy workloads on the same model must agree)."""
    by = {(r["workload"], r["config"]): r for r in rows}
    for r in rows:
        ref = by.get((r["workload"], baseline))
        if ref and r is not ref:
            n = min(len(r["outputs"]), len(ref["outputs"]))
            if n:
                r["agreement_with_baseline"] = sum(a == b for a, b in zip(r["outputs"], ref["outputs"])) / n


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'workload':20} {'config':24} {'progs':>5} {'prog/s':>7} {'lat s':>7} {'acc':>5} {'hit':>6} "
        f"{'opt':>6} {'vs full':>7} {'vs base':>7} {'agree':>5}"
    )
    print("\n" + head + "\n" + "-" * len(head))

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        print(
            f"{r['workload']:20} {r['config']:24} {r['programs']:5d} {f(r['programs_per_s'], '7.3f')} "
            f"{f(r.get('latency_s'), '7.2f')} {f(r.get('accuracy'), '5.2f')} {f(r.get('hit_rate'), '6.3f')} "
            f"{f(r.get('optimal_hit_rate'), '6.3f')} {f(r.get('throughput_vs_full'), '7.2f')} "
            f"{f(r.get('throughput_vs_baseline'), '7.2f')} {f(r.get('agreement_with_baseline'), '5.2f')}"
        )
    print(
        "prog/s: programs per second over the batch; lat s: one program at a time; hit: cached/prompt tokens; "
        "opt: Theorem 3.1 optimum over the prompts the engine got; vs full / vs base: throughput ratios; "
        "agree: share of outputs equal to the baseline's"
    )


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
