"""Online serving benchmark in the style of SGLang's bench_serving: ShareGPT requests with Poisson arrivals at a sweep
of request rates, streamed from the HTTP server's /generate by an async httpx client.

Per request: TTFT (send -> first streamed chunk), TPOT ((latency - TTFT) / (output tokens - 1)), ITL (gaps between
chunks) and end-to-end latency. Per rate: request and token throughput over the whole run (first send -> last byte),
p50 / p99 of each latency, the cache hit rate over the run (deltas of /get_server_info's cached and prompt tokens;
the cache is flushed before each rate), the engine thread's time in steps, radix-tree bookkeeping and detokenization
as shares of the run and, with --health-probe, the latency of /health polled every 50 ms during the
run (the engine thread vs event loop measurement of docs/server.md).

The workload is scripts/perf/bench_engine.py's ShareGPT one (first human turns, chat-templated, prompts cut at
--max-prompt-len tokens, outputs of the reply's length capped at --max-output-len, ignore_eos so every configuration
produces the same tokens). Requests send input_ids, so the client and server agree on every prompt's length.

    .venv/bin/python scripts/perf/bench_serving.py --num-prompts 32 --request-rates 1,4,inf --health-probe \
        --server-args "--max-total-tokens 8192 --max-running-requests 8 --chunked-prefill-size 240" \
        --out docs/results/bench_serving_cpu.jsonl
    python scripts/perf/bench_serving.py --base-url http://127.0.0.1:30000 ...   # a server started elsewhere

Without --base-url the script starts `sgjax serve` itself (on a free port, with the repo's compilation cache) and
stops it with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- one request --------------------------------------------------------------------------------------------------
async def one_request(http: httpx.AsyncClient, req: dict, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = {
        "input_ids": req["input_ids"],
        "stream": True,
        "sampling_params": {"max_new_tokens": req["max_new_tokens"], "temperature": 0.0, "ignore_eos": True},
    }
    start = time.perf_counter()
    chunk_times, last = [], None
    try:
        async with http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk_times.append(time.perf_counter())
                    last = json.loads(line[6:])
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    if last is None or last["meta_info"]["finish_reason"] is None:
        return {"ok": False, "error": "stream ended without a final chunk"}
    meta = last["meta_info"]
    latency = chunk_times[-1] - start
    ttft = chunk_times[0] - start
    out = meta["completion_tokens"]
    return {
        "ok": True,
        "start": start,
        "end": chunk_times[-1],
        "ttft": ttft,
        "latency": latency,
        "tpot": (latency - ttft) / (out - 1) if out > 1 else None,
        "itl": list(np.diff(chunk_times)),
        "prompt_tokens": meta["prompt_tokens"],
        "output_tokens": out,
    }


async def probe_health(url: str, stop: asyncio.Event, out: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while not stop.is_set():
            t = time.perf_counter()
            r = await http.get("/health")
            out.append((time.perf_counter() - t, r.status_code))
            await asyncio.sleep(0.05)


# -- one rate -------------------------------------------------------------------------------------------------------
async def run_rate(url: str, reqs: list[dict], rate: float, seed: int, health: bool) -> dict:
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(reqs)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(reqs))
    delays = np.cumsum(gaps) - gaps[0]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as http:
        assert (await http.post("/flush_cache")).json()["success"]
        before = (await http.get("/get_server_info")).json()
        stop, probes = asyncio.Event(), []
        prober = asyncio.create_task(probe_health(url, stop, probes)) if health else None
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(http, r, d, t0) for r, d in zip(reqs, delays)))
        duration = time.perf_counter() - t0
        stop.set()
        if prober:
            await prober
        after = (await http.get("/get_server_info")).json()
    return summarize(results, duration, before, after, probes)


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(results, duration, before, after, probes) -> dict:
    ok = [r for r in results if r["ok"]]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    ttft, tpot = [r["ttft"] for r in ok], [r["tpot"] for r in ok if r["tpot"] is not None]
    itl, lat = [x for r in ok for x in r["itl"]], [r["latency"] for r in ok]
    row = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_per_s": in_tokens / duration,
        "output_tok_per_s": out_tokens / duration,
        "total_tok_per_s": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "concurrency": sum(lat) / duration,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "steps": after["steps"] - before["steps"],
        "retractions": after["retractions"] - before["retractions"],
    }
    # Engine-thread time: device steps, radix-tree bookkeeping, the admission (policy order and page accounting,
    # its tree matches included) and detokenization (host work between steps).
    for key in ("step_seconds", "tree_seconds", "admit_seconds", "detokenize_seconds"):
        row[key] = after[key] - before.get(key, 0.0) if key in after else 0.0
        row[key.replace("_seconds", "_share")] = row[key] / duration
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", lat)):
        row.update(
            {
                f"{name}_mean_ms": 1e3 * float(np.mean(xs)) if xs else None,
                f"{name}_p50_ms": 1e3 * pct(xs, 50) if xs else None,
                f"{name}_p99_ms": 1e3 * pct(xs, 99) if xs else None,
            }
        )
    if probes:
        hl = [t for t, _ in probes]
        row.update(
            health_probes=len(hl),
            health_non_200=sum(s != 200 for _, s in probes),
            health_p50_ms=1e3 * pct(hl, 50),
            health_p99_ms=1e3 * pct(hl, 99),
            health_max_ms=1e3 * max(hl),
        )
    return row


async def idle_health(url: str, n: int = 100) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await http.get("/health")
            times.append(time.perf_counter() - t)
    return {"health_idle_p50_ms": 1e3 * pct(times, 50), "health_idle_p99_ms": 1e3 * pct(times, 99)}


# -- main -----------------------------------------------------------------------------------------------------------
def build_workload(args) -> dict:
    if args.workload_file:  # bench_engine.py --dump-workload: token ids, for machines without the data or tokenizer
        with open(args.workload_file) as f:
            wl = json.load(f)["workloads"]["sharegpt"]
        return {**wl, "requests": wl["requests"][: args.num_prompts]}
    from bench_engine import sharegpt_workload

    from sgjax.model.tokenizer import load_tokenizer

    return sharegpt_workload(load_tokenizer(), args.num_prompts, args.max_prompt_len, args.max_output_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server; default: start one")
    ap.add_argument("--server-args", default="", help="flags for the `sgjax serve` this script starts")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rates", default="1,4,inf", help="comma-separated requests/s; inf sends all at once")
    ap.add_argument("--max-prompt-len", type=int, default=256, help="prompt tokens at most")
    ap.add_argument("--max-output-len", type=int, default=32, help="output tokens at most")
    ap.add_argument("--seed", type=int, default=1, help="Poisson arrivals")
    ap.add_argument("--health-probe", action="store_true", help="poll /health every 50 ms during each rate")
    ap.add_argument(
        "--workload-file",
        default=None,
        help="the sharegpt workload of a `bench_engine.py --dump-workload` file instead of building it",
    )
    ap.add_argument("--tag", default="", help="a label stored with the rows (e.g. the machine)")
    ap.add_argument("--out", default=None, help="JSON lines (appended)")
    args = ap.parse_args()
    rates = [float(r) for r in args.request_rates.split(",")]
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])

    wl = build_workload(args)
    reqs = wl["requests"]
    server = None
    url = args.base_url
    if url is None:
        from sgjax.server.process import ServerProcess

        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".jax_cache"))
        env = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        server = ServerProcess(*shlex.split(args.server_args), env=env, cwd=REPO).wait_ready()
        url = server.url
    try:
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        # Warm-up outside the measurement: the first steps of each shape compile (or load from the persistent cache).
        asyncio.run(run_rate(url, wl["warmup"], math.inf, args.seed, False))
        common = {
            "workload": "sharegpt",
            "num_prompts": len(reqs),
            "max_prompt_len": max(len(r["input_ids"]) for r in reqs),
            "max_output_len": args.max_output_len,
            "tag": args.tag,
            "command": command,
            "config": {
                k: info["server_args"][k]
                for k in (
                    "page_size",
                    "max_total_tokens",
                    "max_running_requests",
                    "chunked_prefill_size",
                    "schedule_policy",
                    "disable_radix_cache",
                    "attention_backend",
                    "dtype",
                )
            },
            "model": info["served_model_name"],
            "attention_backend": info["attention_backend"],
            **(asyncio.run(idle_health(url)) if args.health_probe else {}),
        }
        rows = []
        for rate in rates:
            row = {
                **common,
                "request_rate": rate,
                **asyncio.run(run_rate(url, reqs, rate, args.seed, args.health_probe)),
            }
            rows.append(row)
            print(f"rate {rate}: {row['completed']} done in {row['duration_s']:.1f} s", flush=True)
    finally:
        if server is not None:
            rc = server.stop()
            print(f"server stopped with SIGTERM, exit status {rc}")
            if rc == 0:
                server.remove_log()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print_table(rows)
    print(f"command: {command}")


def print_table(rows) -> None:
    def ms(x):
        return "-" if x is None else f"{x:.0f}"

    head = (
        f"{'rate':>5} {'done':>4} {'dur s':>6} {'req/s':>6} {'out tok/s':>9} {'ttft p50':>8} {'ttft p99':>8} "
        f"{'tpot p50':>8} {'tpot p99':>8} {'e2e p50':>8} {'e2e p99':>8} {'hit':>5} {'step%':>5} {'detok%':>6} "
        f"{'health p50/p99':>14}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        health = f"{r['health_p50_ms']:.1f}/{r['health_p99_ms']:.1f}" if "health_p50_ms" in r else "-"
        print(
            f"{r['request_rate']:>5} {r['completed']:>4} {r['duration_s']:6.1f} {r['request_throughput']:6.2f} "
            f"{r['output_tok_per_s']:9.1f} {ms(r['ttft_p50_ms']):>8} {ms(r['ttft_p99_ms']):>8} "
            f"{ms(r['tpot_p50_ms']):>8} {ms(r['tpot_p99_ms']):>8} {ms(r['e2e_p50_ms']):>8} "
            f"{ms(r['e2e_p99_ms']):>8} {r['cache_hit_rate']:5.3f} {100 * r['step_share']:5.1f} "
            f"{100 * r['detokenize_share']:6.2f} {health:>14}"
        )
    print(
        "latencies in ms; hit: cached / prompt tokens over the rate's run (cache flushed before it); step%, detok%: "
        "engine-thread time in device steps and in detokenization / run time; health: /health latency in ms"
    )


if __name__ == "__main__":
    main()
