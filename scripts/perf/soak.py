"""The heavy reliability run (issue #27's figures): thousands of fuzzed bodies against a real `sgjax serve`, then
rounds of concurrent streams where a share of the clients leave mid-way or abort by rid, with the page pool and the
server's RSS read after every round.

Figures: bodies tried, 5xx answers, 400s that do not name a field, keep-alive checks that failed (a normal request
on the fuzzing connection after every --check-every bodies), p50 / p99 latency of the load requests that finished,
greedy answers under load that differ from the same prompt answered alone, pages leaked after each round
(num_pages - free - evictable, and protected pages), RSS before and after.

    .venv/bin/python scripts/perf/soak.py --fuzz 2000 --rounds 5 --concurrency 48 \
        --out docs/results/soak_cpu.jsonl
    python scripts/perf/soak.py --base-url http://127.0.0.1:30000 --server-pid 1234   # a server started elsewhere

Without --base-url the script starts `sgjax serve` (the embedded SmolLM2, --server-args added) on a free port and
stops it with SIGTERM at the end; the exit status is part of the figures. The fuzzer is random.Random(--seed): the
same seed sends the same bodies. Exit status 1 when any figure that must be zero is not.
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

from sgjax.server.process import ServerProcess  # noqa: E402

TEMPLATES = {
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
    },
}
TOP = {
    "/generate": [
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "stream",
        "lora_path",
        "return_hidden_states",
        "image_data",
        "bogus",
    ],
    "/v1/completions": [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "logprobs",
        "echo",
        "seed",
        "best_of",
        "top_k",
        "regex",
        "json_schema",
        "stop_token_ids",
        "min_tokens",
        "suffix",
        "user",
    ],
    "/v1/chat/completions": [
        "messages",
        "max_tokens",
        "temperature",
        "n",
        "stop",
        "logprobs",
        "top_logprobs",
        "response_format",
        "seed",
        "tools",
        "tool_choice",
        "store",
        "metadata",
        "reasoning_effort",
        "stream_options",
    ],
}
SAMPLING = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_regex",
    "stop_token_ids",
    "regex",
    "json_schema",
    "ebnf",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_new_tokens",
    "skip_special_tokens",
    "no_stop_trim",
]
# Values that broke things once (issue #27) next to ordinary ones: int32 overflows, deep nesting, costly regexes,
# many stop strings, strings where numbers belong.
NASTY = [
    2**31,
    2**63,
    -(2**31) - 1,
    1e308,
    -1e-300,
    "(" * 400 + ")" * 400,
    "[\u0000-\U0010ffff]{1000}",
    ["x"] * 200,
    ["y" * 5000],
    {"type": "array", "items": {"type": "array", "items": {"type": "array"}}},
    json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}}),
    "",
    None,
    [],
    {},
    True,
]


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(NASTY)
    if kind == 1:
        return rng.randint(-5, 50)
    if kind == 2:
        return rng.uniform(-3, 3)
    if kind == 3:
        return "".join(rng.choice("ab {}[]()\\\"'.*+?|\u00e9\u4e2d") for _ in range(rng.randrange(12)))
    if kind == 4 and depth < 3:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 5 and depth < 3:
        return {
            rng.choice(SAMPLING + ["role", "content", "type"]): value(rng, depth + 1) for _ in range(rng.randrange(4))
        }
    return rng.choice([None, True, False, 0, 1, -1, 0.5, "x"])


def fuzzed_body(rng: random.Random) -> tuple[str, bytes]:
    route = rng.choice(sorted(TEMPLATES))
    if rng.randrange(12) == 0:
        return route, bytes(rng.randrange(256) for _ in range(rng.randrange(48)))
    body = json.loads(json.dumps(TEMPLATES[route]))
    for _ in range(rng.randint(1, 4)):
        nested = route == "/generate" and rng.random() < 0.6
        where = body.setdefault("sampling_params", {}) if nested else body
        if not isinstance(where, dict):
            where = body
        key = rng.choice(SAMPLING if where is not body else TOP[route])
        if rng.randrange(6) == 0:
            where.pop(key, None)
        else:
            where[key] = value(rng)
    return route, json.dumps(body).encode()


def field_paths(obj, prefix: str = "") -> set[str]:
    out = {prefix} if prefix else set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out |= field_paths(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out |= field_paths(v, f"{prefix}.{i}" if prefix else str(i))
    return out


def names_a_field(raw: bytes, answer: dict) -> bool:
    err = answer.get("error") if isinstance(answer, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    if not param:
        return False
    try:
        sent = field_paths(json.loads(raw)) | {"body"}
    except ValueError:
        sent = {"body"}
    # a field the client sent, or the route's prompt field (missing or too long)
    return param in sent or param.split(".")[0] in sent | {"text", "prompt", "messages", "input_ids", "body"}


NORMAL = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def fuzz(url: str, n: int, seed: int, check_every: int, timeout: float) -> dict:
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    server_errors, unnamed, gave_up, keepalive_failed = [], 0, 0, 0
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout) as conn:
        for i in range(n):
            route, raw = fuzzed_body(rng)
            try:
                r = conn.post(route, content=raw, headers={"content-type": "application/json"})
            except httpx.TimeoutException:  # a valid body that generates for long: leaving aborts it
                gave_up += 1
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                server_errors.append(
                    {
                        "route": route,
                        "body": raw[:300].decode("utf-8", "replace"),
                        "status": r.status_code,
                        "answer": r.text[:300],
                    }
                )
            elif r.status_code == 400 and not names_a_field(raw, r.json()):
                unnamed += 1
            if (i + 1) % check_every == 0:
                try:
                    ok = conn.post("/generate", json=NORMAL, timeout=120).json()["meta_info"]["completion_tokens"] == 2
                except (httpx.HTTPError, KeyError, ValueError):
                    ok = False
                keepalive_failed += not ok
    return {
        "bodies": n,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": len(server_errors),
        "first_server_errors": server_errors[:5],
        "unnamed_400": unnamed,
        "client_gave_up": gave_up,
        "keepalive_failed": keepalive_failed,
        "seconds": round(time.perf_counter() - t0, 1),
    }


# -- load rounds ----------------------------------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time",
    "Water boils at",
    "The best way to learn a language is",
    "Translate 'cat' to French:",
    "1, 2, 3, 4,",
]


async def stream_one(http: httpx.AsyncClient, rng: random.Random, leave_after: int | None, rid: str) -> dict:
    body = {
        "text": rng.choice(PROMPTS),
        "rid": rid,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0, 0.8]),
            "ignore_eos": True,
        },
    }
    start, chunks = time.perf_counter(), 0
    try:
        async with http.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return {"status": "left"}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    return {"status": 200, "latency": time.perf_counter() - start}


async def greedy_one(http: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
    r = await http.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    return prompt, r.json().get("text") if r.status_code == 200 else None


async def abort_later(http: httpx.AsyncClient, rid: str, delay: float) -> None:
    await asyncio.sleep(delay)
    await http.post("/abort_request", json={"rid": rid})


async def load_round(
    url: str,
    rng: random.Random,
    concurrency: int,
    leave_share: float,
    abort_share: float,
    alone: dict[str, str],
    round_no: int,
) -> dict:
    async with httpx.AsyncClient(
        base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency * 2 + 8)
    ) as http:
        tasks, aborts = [], []
        t0 = time.perf_counter()
        for i in range(concurrency):
            rid = f"soak-{round_no}-{i}"
            leave = rng.randint(1, 6) if rng.random() < leave_share else None
            tasks.append(stream_one(http, rng, leave, rid))
            if rng.random() < abort_share:
                aborts.append(abort_later(http, rid, rng.uniform(0.05, 1.0)))
        greedy = [greedy_one(http, p) for p in PROMPTS]
        results = await asyncio.gather(*tasks, *greedy, *aborts)
        wall = time.perf_counter() - t0
    streams, answers = results[:concurrency], results[concurrency : concurrency + len(PROMPTS)]
    lat = [r["latency"] for r in streams if "latency" in r]
    outcome: dict[str, int] = {}
    for r in streams:
        outcome[str(r["status"])] = outcome.get(str(r["status"]), 0) + 1
    return {
        "wall_s": round(wall, 2),
        "outcomes": outcome,
        "finished": len(lat),
        "req_per_s": round(len(lat) / wall, 2),
        "p50_s": round(float(np.percentile(lat, 50)), 3) if lat else None,
        "p99_s": round(float(np.percentile(lat, 99)), 3) if lat else None,
        "server_errors": sum(str(r["status"]).startswith("5") for r in streams),
        "greedy_differs": sum(text != alone[p] for p, text in answers),
    }


def wait_idle(client: httpx.Client, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/get_server_info").json()
        if info["running_requests"] == info["waiting_requests"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def pages_leaked(info: dict) -> int:
    return info["num_pages"] - info["free_pages"] - info["evictable_pages"]


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--server-pid", type=int, help="with --base-url: read this process's RSS")
    ap.add_argument("--server-args", default="", help="extra `sgjax serve` flags when the script starts it")
    ap.add_argument("--fuzz", type=int, default=2000, help="fuzzed bodies")
    ap.add_argument("--check-every", type=int, default=100, help="a normal request on the fuzzing connection every N")
    ap.add_argument("--fuzz-timeout", type=float, default=2.0, help="seconds a fuzzed request may take")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--leave-share", type=float, default=0.4, help="streams that disconnect after a few chunks")
    ap.add_argument("--abort-share", type=float, default=0.1, help="streams aborted by rid mid-way")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args()

    srv = None
    if args.base_url:
        url, pid = args.base_url, args.server_pid
    else:
        srv = ServerProcess(
            *shlex.split(args.server_args), cwd=REPO, env={"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        ).wait_ready(900)
        url, pid = srv.url, srv.proc.pid
    config = {
        "server_args": args.server_args,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "leave_share": args.leave_share,
        "abort_share": args.abort_share,
    }
    rows = []
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            alone = {
                p: client.post(
                    "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
                ).json()["text"]
                for p in PROMPTS
            }
            rss_start = rss_mib(pid)
            f = fuzz(url, args.fuzz, args.seed, args.check_every, args.fuzz_timeout)
            info = wait_idle(client)
            rows.append(
                {
                    "workload": "fuzz",
                    "configuration": config,
                    **f,
                    "pages_leaked": pages_leaked(info),
                    "rss_before_mib": rss_start,
                    "rss_after_mib": rss_mib(pid),
                }
            )
            rng = random.Random(args.seed + 1)
            for k in range(args.rounds):
                before = rss_mib(pid)
                r = asyncio.run(load_round(url, rng, args.concurrency, args.leave_share, args.abort_share, alone, k))
                info = wait_idle(client)
                rows.append(
                    {
                        "workload": f"load round {k}",
                        "configuration": config,
                        **r,
                        "pages_leaked": pages_leaked(info),
                        "protected_pages": info["protected_pages"],
                        "rss_before_mib": before,
                        "rss_after_mib": rss_mib(pid),
                    }
                )
    finally:
        exit_status = srv.stop() if srv else None
    bad = 0
    print(
        f"{'workload':<14} {'n':>6} {'5xx':>4} {'unnamed400':>10} {'keepalive':>9} {'p50 s':>7} {'p99 s':>7} "
        f"{'req/s':>6} {'greedy!=':>8} {'leaked':>6} {'RSS MiB':>15}"
    )
    for row in rows:
        n = row.get("bodies", row.get("finished"))
        rss = f"{row['rss_before_mib']}->{row['rss_after_mib']}"
        print(
            f"{row['workload']:<14} {n:>6} {row['server_errors']:>4} {row.get('unnamed_400', '-'):>10} "
            f"{row.get('keepalive_failed', '-'):>9} {str(row.get('p50_s', '-')):>7} {str(row.get('p99_s', '-')):>7} "
            f"{str(row.get('req_per_s', '-')):>6} {row.get('greedy_differs', '-'):>8} {row['pages_leaked']:>6} "
            f"{rss:>15}"
        )
        bad += row["server_errors"] + row.get("unnamed_400", 0) + row.get("keepalive_failed", 0) + row["pages_leaked"]
    if srv:
        print(f"server exit status after SIGTERM: {exit_status}")
        bad += exit_status != 0
    for row in rows[:1]:
        for e in row["first_server_errors"]:
            print("5xx:", json.dumps(e))
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "server_exit_status": exit_status}) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
