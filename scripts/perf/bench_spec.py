"""Speculative decoding (NGRAM, SELF) against plain decoding, on the real SmolLM2, per workload and concurrency.

    python scripts/perf/bench_spec.py                              # 8 requests per workload, 1 / 4 / 16 at a time
    python scripts/perf/bench_spec.py --workloads rag --concurrency 1 --num-draft-tokens 4 6 8
    python scripts/perf/bench_spec.py --self-draft-layers 20 28 --num-draft-tokens 4   # self-speculation too

Workloads (chat-templated, greedy, --max-new-tokens each; built from the packaged data):
  summarize   a SQuAD paragraph, "summarize it in a few sentences"
  rag         three SQuAD paragraphs and a question about one of them, "answer quoting the passages"
  chat        a ShareGPT conversation's first two turns replayed as history, then its next question
  json        a SQuAD paragraph, "extract title, topic, three facts and the numbers as JSON" (unconstrained text)
Every engine is the defaults, plus --speculative-algorithm NGRAM (or SELF) for the speculative ones; each
(workload, concurrency) runs plain and then each speculative engine, interleaved, and the greedy outputs must agree
(a disagreement is reported, never hidden).
Rows: tok/s per request (completion tokens / its latency, mean over requests), total tok/s, accept length (tokens a
verifying row adds per step), the ratio to plain decoding measured in the same run. JSON lines go to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import statistics
import time

WORKLOADS = ("summarize", "rag", "chat", "json")


def chat_prompt(tok, messages) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build(name: str, n: int, tok) -> list[str]:
    from sgjax.data import sharegpt, squad

    paragraphs = [r["query"].split("Background: ", 1)[-1].rsplit("\nQuestion:", 1)[0] for r in squad()]
    paragraphs = list(dict.fromkeys(p for p in paragraphs if 400 < len(p) < 1500))
    out = []
    for i in range(n):
        p = paragraphs[i]
        if name == "summarize":
            msgs = [{"role": "user", "content": f"{p}\n\nSummarize the passage above in a few sentences."}]
        elif name == "rag":
            docs = [paragraphs[i], paragraphs[i + n], paragraphs[i + 2 * n]]
            first = docs[0].split(". ")[0]
            ctx = "\n\n".join(f"[{j + 1}] {d}" for j, d in enumerate(docs))
            question = f"What do the passages say about this: {first}?"
            msgs = [{"role": "user", "content": f"Passages:\n{ctx}\n\n{question} Answer quoting the passages."}]
        elif name == "json":
            msgs = [
                {
                    "role": "user",
                    "content": f"{p}\n\nExtract from the passage as JSON: "
                    '{"title": ..., "topic": ..., "facts": [three facts], "numbers": [every number mentioned]}.',
                }
            ]
        elif name == "chat":
            convs = [c["conversations"] for c in sharegpt(400) if len(c["conversations"]) >= 5]
            turns = convs[i]
            roles = {"human": "user", "gpt": "assistant"}
            msgs = [{"role": roles.get(t["from"], "user"), "content": t["value"][:1200]} for t in turns[:4]]
            msgs.append({"role": "user", "content": turns[4]["value"][:600]})
        else:
            raise SystemExit(f"unknown workload {name!r}; known: {WORKLOADS}")
        out.append(chat_prompt(tok, msgs))
    return out


def measure(engine, prompts, concurrency: int, max_new: int) -> dict:
    params = {"max_new_tokens": max_new, "temperature": 0}
    before = engine.get_server_info()

    def one(prompt):
        t0 = time.perf_counter()
        out = engine.generate(prompt, params)
        return out, time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    after = engine.get_server_info()
    tokens = sum(len(o["output_ids"]) for o, _ in results)
    rows = after["spec_rows"] - before["spec_rows"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {
        "outputs": [o["output_ids"] for o, _ in results],
        "tokens": tokens,
        "wall_s": wall,
        "tok_per_s": tokens / wall,
        "tok_per_s_per_request": statistics.mean(len(o["output_ids"]) / dt for o, dt in results),
        "latency_s": statistics.mean(dt for _, dt in results),
        "verify_rows": rows,
        "accept_length": (rows + accepted) / rows if rows else None,
        "drafted": after["spec_drafted_tokens"] - before["spec_drafted_tokens"],
        "accepted": accepted,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--num-requests", type=int, default=8, help="per workload (at least the largest concurrency)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", nargs="+", type=int, default=[6], help="--speculative-num-draft-tokens")
    ap.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="--speculative-disable-by-batch-size for the speculative engines (named ngram-K-lt-N)",
    )
    ap.add_argument(
        "--self-draft-layers",
        nargs="*",
        type=int,
        default=[],
        help="also SELF (self-speculation) engines drafting with these many first layers (named self-L-K)",
    )
    ap.add_argument("--no-ngram", action="store_true", help="no NGRAM engines (SELF ones only)")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--out", default="/tmp/bench_spec.jsonl")
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()

    from sgjax.engine.engine import Engine

    common = dict(max_total_tokens=args.max_total_tokens, max_running_requests=max(args.concurrency))
    engines = {"plain": Engine(**common)}
    cap = args.disable_by_batch_size
    for k in args.num_draft_tokens:
        spec = dict(speculative_num_draft_tokens=k, speculative_disable_by_batch_size=cap)
        if not args.no_ngram:
            engines[f"ngram-{k}" + (f"-lt-{cap}" if cap else "")] = Engine(
                **common, speculative_algorithm="NGRAM", **spec
            )
        for layers in args.self_draft_layers:
            engines[f"self-{layers}-{k}" + (f"-lt-{cap}" if cap else "")] = Engine(
                **common, speculative_algorithm="SELF", speculative_draft_layers=layers, **spec
            )
    tok = engines["plain"].tokenizer
    rows = []
    for name in args.workloads:
        prompts = build(name, max(args.num_requests, max(args.concurrency)), tok)
        for eng in engines.values():  # compiles and the prompts' prefixes out of the timed runs
            eng.generate(prompts[:2], {"max_new_tokens": 8, "temperature": 0})
        for c in args.concurrency:
            base = base_outputs = None
            for config, eng in engines.items():
                eng.flush_cache()
                r = measure(eng, prompts, c, args.max_new_tokens)
                outputs = r.pop("outputs")
                base, base_outputs = base or r, base_outputs or outputs
                agree = sum(a == b for a, b in zip(outputs, base_outputs)) / len(prompts)
                rows.append(
                    {
                        "workload": name,
                        "configuration": config,
                        "concurrency": c,
                        "requests": len(prompts),
                        "max_new_tokens": args.max_new_tokens,
                        **r,
                        "greedy_agreement_with_plain": agree,
                        "speedup_per_request": r["tok_per_s_per_request"] / base["tok_per_s_per_request"],
                        "speedup_total": r["tok_per_s"] / base["tok_per_s"],
                        "cpu": platform.processor() or platform.machine(),
                        "tag": args.tag,
                    }
                )
                row = rows[-1]
                acc = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
                print(
                    f"{name:9} {config:14} c={c:<3d} {row['tok_per_s_per_request']:7.1f} tok/s/req "
                    f"{row['tok_per_s']:7.1f} tok/s  accept {acc:>5}  x{row['speedup_per_request']:.2f}/req "
                    f"x{row['speedup_total']:.2f} total  agree {agree:.2f}",
                    flush=True,
                )
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for eng in engines.values():
        eng.shutdown()


if __name__ == "__main__":
    main()
