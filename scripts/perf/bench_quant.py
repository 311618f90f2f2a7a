"""Quantization's accuracy against bf16 on the real SmolLM2, all configurations in one run.

    python scripts/perf/bench_quant.py                       # fp8 and int8 weights against bf16
    python scripts/perf/bench_quant.py --quantization --kv-cache-dtype fp8_e4m3 fp8_e5m2 --kv-scales
                                      # fp8 pools against bf16's, unscaled and with scales measured on the bf16 pool

Every configuration is an engine over the same checkpoint with --dtype bfloat16 (the reference: bf16 matrices and
pool) and either --quantization fp8 / int8 (weights only; activations and the KV pool stay bf16) or --kv-cache-dtype
fp8_e4m3 / fp8_e5m2 (the pool only; `--quantization` with no value: no weight quantization). Every configuration
takes the platform's attention backend (on a CPU the native kernel, which reads bf16 and fp8 pools alike), so the
reference differs in the pool alone. Per configuration:
  kl           mean and p99 KL(bf16 || quantized) of the next-token distribution (the engine's full-vocabulary
               logprobs readout) after --kl-prompts prefixes of ShareGPT turns, cut at 16-256 tokens
  agreement    greedy decoding of --prompts chat prompts for --new-tokens tokens: the share of outputs identical to
               bf16's, and the mean share of each output's tokens before its first difference
  mmlu         5-shot accuracy on --mmlu-subjects (the answer letter with the highest next-token logprob)
  greedy tok/s the greedy batch's new tokens over its wall time (prefills included, all at once up to
               --max-running): a rough speed beside the accuracy, on a machine that runs nothing else
--kv-scales adds each fp8 pool again with scales per layer that `sgjax kv-scales`' measurement
(engine/kv_calibrate.py) takes from the bf16 engine's pool over --kv-scales-prompts ShareGPT prompts, passed as
--quantization-param-path.
Prints a table and appends JSON lines to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SUBJECTS = "world_religions,management,high_school_biology,college_computer_science"


def kl_prompts(tok, n: int) -> list[list[int]]:
    from sgjax.data import sharegpt

    rng = np.random.default_rng(0)
    out = []
    for conv in sharegpt(2000):
        for turn in conv.get("conversations", []):
            ids = tok.encode(turn.get("value", ""))
            if len(ids) >= 32:
                out.append(ids[: int(rng.integers(16, min(len(ids), 256) + 1))])
            if len(out) == n:
                return out
    return out


def chat_prompts(tok, n: int) -> list[list[int]]:
    from sgjax.data import sharegpt

    out = []
    for conv in sharegpt(2000):
        turns = conv.get("conversations", [])
        if turns and turns[0].get("from") == "human" and 10 < len(turns[0]["value"]) < 1500:
            msgs = [{"role": "user", "content": turns[0]["value"]}]
            out.append(tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)))
        if len(out) == n:
            break
    return out


def mmlu_set(tok, subjects: list[str], per: int):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_engine import _mmlu_prefix, _mmlu_question

    from sgjax.data import mmlu

    prompts, gold = [], []
    for subject in subjects:
        prefix = tok.encode(_mmlu_prefix(subject, mmlu("dev", subject)))
        for r in mmlu("test", subject)[:per]:
            prompts.append(prefix + tok.encode(_mmlu_question(r), add_special_tokens=False))
            gold.append(r["answer"])
    letters = [tok.encode(" " + c, add_special_tokens=False)[-1] for c in "ABCD"]
    return prompts, np.asarray(gold), letters


def logprobs(engine, prompts, chunk: int = 8) -> np.ndarray:
    return np.concatenate(
        [
            np.asarray(engine._call(lambda p=prompts[i : i + chunk]: engine._readout("logprobs", p)))
            for i in range(0, len(prompts), chunk)
        ]
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", nargs="*", default=["fp8", "int8"])
    ap.add_argument("--kv-cache-dtype", nargs="*", default=[], help="fp8_e4m3 / fp8_e5m2 pools against bf16's")
    ap.add_argument("--attention-backend", default=None, help="every configuration's (default: the platform's)")
    ap.add_argument("--kv-scales", action="store_true", help="each fp8 pool again with measured scales per layer")
    ap.add_argument("--kv-scales-prompts", type=int, default=64)
    ap.add_argument("--kl-prompts", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--mmlu-subjects", default=SUBJECTS)
    ap.add_argument("--mmlu-per-subject", type=int, default=50)
    ap.add_argument("--model-path", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--max-running", type=int, default=16, help="every engine's --max-running-requests")
    ap.add_argument("--out", default="/tmp/bench_quant.jsonl")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()

    from sgjax.engine.engine import Engine

    common = dict(
        model_path=args.model_path, dtype="bfloat16", max_total_tokens=65536, max_running_requests=args.max_running
    )
    if args.attention_backend:
        common["attention_backend"] = args.attention_backend
    scaled = args.kv_cache_dtype if args.kv_scales else []
    scales_file = lambda k: f"{args.out}.{k}.scales.json"  # noqa: E731  (written by the bf16 engine, below)
    configs = {
        "bf16": {},
        **{q: {"quantization": q} for q in args.quantization},
        **{f"kv-{k}": {"kv_cache_dtype": k} for k in args.kv_cache_dtype},
        **{f"kv-{k}+scales": {"kv_cache_dtype": k, "quantization_param_path": scales_file(k)} for k in scaled},
    }
    rows, ref = [], {}
    for name, extra in configs.items():
        with Engine(**common, **extra) as eng:
            tok = eng.tokenizer
            if not ref:
                kl_set, chats = kl_prompts(tok, args.kl_prompts), chat_prompts(tok, args.prompts)
                mm_prompts, gold, letters = mmlu_set(tok, args.mmlu_subjects.split(","), args.mmlu_per_subject)
            lp = logprobs(eng, kl_set)
            start = time.perf_counter()
            outs = [
                o["output_ids"]
                for o in eng.generate(
                    input_ids=chats,
                    sampling_params={"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True},
                )
            ]
            greedy_s = time.perf_counter() - start
            mm = logprobs(eng, mm_prompts)[:, letters]
            acc = float((mm.argmax(axis=1) == gold).mean())
            plan = eng.get_server_info()["step_plan"]
            for k in scaled if name == "bf16" else []:  # after bf16's own measurements, which it must not touch
                from sgjax.engine.kv_calibrate import measure

                calibration = chat_prompts(tok, args.prompts + args.kv_scales_prompts)[args.prompts :]
                with open(scales_file(k), "w") as f:  # ShareGPT prompts past the agreement set's
                    json.dump(measure(eng, calibration, k), f)
        if not ref:
            ref.update(lp=lp, outs=outs)
        p = np.exp(ref["lp"])
        kl = (p * (ref["lp"] - lp)).sum(axis=1)
        same = [a == b for a, b in zip(outs, ref["outs"])]
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a)
            for a, b in zip(outs, ref["outs"])
        ]
        rows.append(
            {
                "configuration": name,
                "weight_dtype": plan["weight_dtype"],
                "kv_dtype": plan["kv_dtype"],
                "attention": plan["attention"],
                "matmul": plan["matmul"],
                "kv_scales": plan.get("kv_scales"),
                "kl_mean": float(kl.mean()),
                "kl_p99": float(np.percentile(kl, 99)),
                "kl_prompts": len(kl_set),
                "greedy_identical": float(np.mean(same)),
                "greedy_prefix_share": float(np.mean(prefix)),
                "prompts": len(chats),
                "new_tokens": args.new_tokens,
                "greedy_tok_s": sum(map(len, outs)) / greedy_s,
                "mmlu_5shot": acc,
                "mmlu_questions": len(gold),
                "model": args.model_path or "SmolLM2-135M-Instruct (bundled)",
                "tag": args.tag,
            }
        )
        r = rows[-1]
        print(
            f"{name:11} {r['weight_dtype']:9} {r['kv_dtype']:13} KL mean {r['kl_mean']:.5f} p99 {r['kl_p99']:.4f}  "
            f"greedy identical {r['greedy_identical']:.2f} prefix {r['greedy_prefix_share']:.2f}  MMLU {acc:.3f}  "
            f"greedy {r['greedy_tok_s']:.1f} tok/s",
            flush=True,
        )
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
