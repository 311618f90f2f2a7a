"""Tool calling over HTTP: BFCL-style requests to /v1/chat/completions, with and without the calls' grammar.

Each task is one of bfcl-eval's function-calling questions (BFCL v4 simple_python by default: one function, one
expected call, its accepted argument values). Configurations, in one run:

  free-auto, free-named    --disable-tool-call-constraint: the same prompts, calls decoded freely and parsed
  auto, required, named    the default server: tool_choice auto / required / the task's function named

Per configuration: calls/s and requests/s over the run (first send -> last answer), p50 / p99 latency, the validity
rate (answers with exactly one call whose arguments parse and validate against the function's schema, with
jsonschema), the AST accuracy (BFCL's check of the call against the accepted values; sgjax.data.bfcl_ast_match), the
share of output tokens jump-forward appended without decoding (/get_server_info's counters), cut-off answers
(finish_reason length), and the throughput ratio to the unconstrained row of the same tool_choice (free-named for
named, free-auto for auto and required) measured in the same run. Prints a table and writes JSON lines.

    .venv/bin/python scripts/perf/bench_tools.py --num-tasks 50 --out out/bench_tools.jsonl
    .venv/bin/python scripts/perf/bench_tools.py --server-args "--max-total-tokens 8192 --max-running-requests 16"

Needs `pip install --no-deps bfcl-eval==2026.3.23` (make setup installs it). The script starts `sgjax serve` itself
(twice: with and without the constraint), on free ports, with the repo's compilation cache.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shlex
import sys
import time

import httpx
import jsonschema
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from sgjax.data import bfcl, bfcl_ast_match  # noqa: E402

CONFIGS = {  # name -> (server, tool_choice)
    "free-auto": ("free", "auto"),
    "free-named": ("free", "named"),
    "auto": ("constrained", "auto"),
    "required": ("constrained", "required"),
    "named": ("constrained", "named"),
}
BASELINE = {"auto": "free-auto", "required": "free-auto", "named": "free-named"}


def request(task: dict, choice: str, max_tokens: int) -> dict:
    tool_choice = (
        {"type": "function", "function": {"name": task["tools"][0]["function"]["name"]}}
        if choice == "named"
        else choice
    )
    return {
        "model": "m",
        "messages": task["messages"],
        "tools": task["tools"],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def judge(task: dict, answer: dict) -> dict:
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    valid = ast = False
    if len(calls) == 1:
        fn = calls[0]["function"]
        spec = next((t["function"] for t in task["tools"] if t["function"]["name"] == fn["name"]), None)
        try:
            args = json.loads(fn["arguments"])
            if spec is not None:
                jsonschema.validate(args, spec["parameters"])
                valid = True
                ast = bfcl_ast_match(fn["name"], args, task["ground_truth"])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {
        "valid": valid,
        "ast": ast,
        "calls": len(calls),
        "cut": choice["finish_reason"] == "length",
        "tokens": answer["usage"]["completion_tokens"],
    }


def run_config(url: str, tasks: list[dict], choice: str, args) -> dict:
    with httpx.Client(base_url=url, timeout=600) as http:
        before = http.get("/get_server_info").json()

        def one(task):
            start = time.perf_counter()
            r = http.post("/v1/chat/completions", json=request(task, choice, args.max_tokens))
            r.raise_for_status()
            return {**judge(task, r.json()), "latency": time.perf_counter() - start}

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            rows = list(pool.map(one, tasks))
        wall = time.perf_counter() - t0
        after = http.get("/get_server_info").json()
    jumped = after["jump_forward_tokens"] - before["jump_forward_tokens"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    lat = np.array([r["latency"] for r in rows])
    n = len(rows)
    return {
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "calls_per_s": sum(r["calls"] for r in rows) / wall,
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "validity": sum(r["valid"] for r in rows) / n,
        "ast_accuracy": sum(r["ast"] for r in rows) / n,
        "cut_off": sum(r["cut"] for r in rows),
        "answers_with_calls": sum(r["calls"] > 0 for r in rows),
        "output_tokens": generated,
        "jump_forward_share": jumped / generated if generated else 0.0,
    }


def start(flags: list[str]):
    from sgjax.server.process import ServerProcess

    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".jax_cache"))
    env = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return ServerProcess(*flags, env=env, cwd=REPO).wait_ready()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--category", default="simple_python", help="BFCL v4 category (one expected call per task)")
    ap.add_argument("--num-tasks", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument(
        "--server-args", default="--max-total-tokens 8192 --max-running-requests 8 --chunked-prefill-size 256"
    )
    ap.add_argument("--out", default="out/bench_tools.jsonl")
    args = ap.parse_args()
    tasks = list(bfcl(args.category)[: args.num_tasks])
    names = args.configs.split(",")
    results = {}
    for server_kind in ("free", "constrained"):
        mine = [c for c in names if CONFIGS[c][0] == server_kind]
        if not mine:
            continue
        flags = shlex.split(args.server_args) + (["--disable-tool-call-constraint"] if server_kind == "free" else [])
        server = start(flags)
        try:
            run_config(server.url, tasks[:2], "named", args)  # warm-up: step shapes, the first grammars
            for name in mine:
                results[name] = run_config(server.url, tasks, CONFIGS[name][1], args)
                print(f"  {name}: {results[name]['wall_s']:.1f} s", file=sys.stderr)
        finally:
            server.stop()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    header = (
        f"{'config':<11}{'req/s':>7}{'calls/s':>8}{'p50 s':>7}{'p99 s':>7}{'valid':>7}{'AST':>6}"
        f"{'jump%':>7}{'cut':>5}{'vs free':>8}"
    )
    print(f"BFCL {args.category}, {len(tasks)} tasks, max_tokens {args.max_tokens}, concurrency {args.concurrency}")
    print(header)
    with open(args.out, "w") as f:
        for name in names:
            r = results[name]
            base = results.get(BASELINE.get(name, name))
            ratio = r["requests_per_s"] / base["requests_per_s"] if base else None
            print(
                f"{name:<11}{r['requests_per_s']:>7.2f}{r['calls_per_s']:>8.2f}{r['latency_p50_s']:>7.1f}"
                f"{r['latency_p99_s']:>7.1f}{r['validity']:>7.2f}{r['ast_accuracy']:>6.2f}"
                f"{100 * r['jump_forward_share']:>7.1f}{r['cut_off']:>5}"
                f"{'' if ratio is None else f'{ratio:.2f}x':>8}"
            )
            f.write(
                json.dumps(
                    {
                        "workload": f"bfcl_{args.category}",
                        "num_tasks": len(tasks),
                        "config": name,
                        "server": CONFIGS[name][0],
                        "tool_choice": CONFIGS[name][1],
                        "max_tokens": args.max_tokens,
                        "concurrency": args.concurrency,
                        "server_args": args.server_args,
                        **r,
                        "ratio_to_unconstrained": ratio,
                        "baseline": BASELINE.get(name),
                    }
                )
                + "\n"
            )


if __name__ == "__main__":
    main()
