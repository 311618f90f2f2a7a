"""Multi-LoRA throughput (engine/adapters.py): the same batch of requests on the base model, and spread over 1, 4 and
8 distinct adapters in one batch, against an engine without LoRA in the same run.

Adapters are random PEFT-format directories of rank --rank on all seven projections of the model (written here
with safetensors, no weights needed from anywhere). Every configuration runs the same prompts at the same
concurrency; `lora-base` is the LoRA engine serving base requests (the cost of carrying the slots).

    PYTHONPATH=. python scripts/perf/bench_lora.py --out docs/results/bench_lora_cpu.jsonl   # SmolLM2, this CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    from safetensors.numpy import save_file

    from sgjax.model.lora import MODULES, module_shape

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in MODULES:
            fan_in, fan_out = module_shape(cfg, module)
            part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / fan_in**0.5).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((fan_out, rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(conf, f)
    return path


def measure(engine, prompts, names, concurrency: int, max_new: int) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}

    def one(item):
        prompt, name = item
        t0 = time.perf_counter()
        out = engine.generate(prompt, params, lora_path=name)
        return out, time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, zip(prompts, names)))
    wall = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o, _ in results)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "latency_s": statistics.mean(dt for _, dt in results),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 8], help="distinct adapters in the batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per configuration (best kept), interleaved")
    ap.add_argument("--out", default="/tmp/bench_lora.jsonl")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()

    from sgjax.engine.engine import Engine

    most = max(args.adapters)
    common = dict(max_total_tokens=16384, max_running_requests=args.concurrency)
    plain = Engine(**common)
    tmp = tempfile.mkdtemp(prefix="sgjax-lora-")
    paths = [
        f"a{i}=" + write_adapter(os.path.join(tmp, f"a{i}"), plain.model_config, args.rank, i) for i in range(most)
    ]
    lora = Engine(**common, enable_lora=True, lora_paths=paths, max_loras_per_batch=most, max_lora_rank=args.rank)
    tok = plain.tokenizer
    topics = ["the sea", "a city at night", "autumn", "a robot", "tea", "mountains", "a library", "rain"]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about {topics[i % 8]} ({i})."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.num_requests)
    ]
    configs = {"plain": (plain, [None] * len(prompts)), "lora-base": (lora, [None] * len(prompts))}
    for k in args.adapters:
        configs[f"lora-{k}"] = (lora, [f"a{i % k}" for i in range(len(prompts))])
    for eng, names in configs.values():  # compiles out of the timed runs
        eng.generate(prompts[:2], {"max_new_tokens": 4, "temperature": 0}, lora_path=names[:2])
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for name, (eng, names) in configs.items():
            eng.flush_cache()
            r = measure(eng, prompts, names, args.concurrency, args.max_new_tokens)
            if name not in best or r["tok_per_s"] > best[name]["tok_per_s"]:
                best[name] = r
    rows = []
    for name, r in best.items():
        rows.append(
            {
                "workload": "chat-stories",
                "configuration": name,
                "requests": len(prompts),
                "concurrency": args.concurrency,
                "max_new_tokens": args.max_new_tokens,
                "rank": args.rank,
                **r,
                "ratio_to_plain": r["tok_per_s"] / best["plain"]["tok_per_s"],
                "platform": platform.processor() or platform.machine(),
                "tag": args.tag,
            }
        )
        print(
            f"{name:10} {r['tok_per_s']:8.1f} tok/s  latency {r['latency_s']:6.2f} s  "
            f"x{rows[-1]['ratio_to_plain']:.2f} of plain",
            flush=True,
        )
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lora.shutdown()
    plain.shutdown()


if __name__ == "__main__":
    main()
