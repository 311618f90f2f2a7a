"""JSON decoding with the compressed FSM: jump-forward on and off, and grammars rebuilt per request vs cached.

The paper (Section 4, Figure 10): jump-forward gives 1.6x on JSON decoding; rebuilding the FSM per request costs
2.4x. Same workload, same engine settings, in one run:

  jump-forward   cached grammars, forced text appended as one extend (the default)
  no-jump        cached grammars, every forced token decoded in its own step (--disable-jump-forward)
  rebuild        jump-forward, but each request compiles its grammar again (grammar_cache_size=0)

Every output is parsed and validated with jsonschema: invalid outputs must be 0.

    .venv/bin/python scripts/perf/bench_json.py                              # CPU, SmolLM2
    python scripts/perf/bench_json.py --dummy llama3-8b --tokenizer-dir DIR  # GPU: dummy 8B weights, SmolLM2 tokenizer
    .venv/bin/python scripts/perf/bench_json.py --dump-tokenizer DIR         # write SmolLM2's tokenizer.json for that
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", "..", ".jax_cache"))

import jax  # noqa: E402

jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "New York"]},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "[0-9]{5}"},
                },
                "required": ["street", "zip"],
            },
        },
        "required": ["name", "age", "city", "skills", "address"],
    },
    "product": {
        "type": "object",
        "properties": {
            "product_name": {"type": "string", "maxLength": 24},
            "price_in_dollars": {"type": "integer", "minimum": 1, "maximum": 10000},
            "in_stock": {"type": "boolean"},
            "category": {"type": "string", "enum": ["electronics", "books", "clothing", "food"]},
            "dimensions": {
                "type": "object",
                "properties": {
                    "width_cm": {"type": "integer", "minimum": 0, "maximum": 999},
                    "height_cm": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["width_cm", "height_cm"],
            },
        },
        "required": ["product_name", "price_in_dollars", "in_stock", "category", "dimensions"],
    },
    "event": {
        "type": "object",
        "properties": {
            "event_title": {"type": "string", "maxLength": 30},
            "date": {"type": "string", "format": "date"},
            "attendee_count": {"type": "integer", "minimum": 0, "maximum": 5000},
            "is_online": {"type": "boolean"},
            "organizer": {
                "type": "object",
                "properties": {
                    "full_name": {"type": "string", "maxLength": 20},
                    "email_address": {"type": "string", "maxLength": 30},
                },
                "required": ["full_name", "email_address"],
            },
        },
        "required": ["event_title", "date", "attendee_count", "is_online", "organizer"],
    },
}
TOPICS = ["a software engineer", "a chef", "a teacher", "a pilot", "a gardener", "a doctor", "a painter", "a runner"]

CONFIGS = {
    "jump-forward": {},
    "no-jump": {"disable_jump_forward": True},
    "rebuild": {"grammar_cache_size": 0},
}


def workload(tokenizer, n: int):
    reqs = []
    for i in range(n):
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        ask = f"Write a JSON object describing a {name} related to {TOPICS[i % len(TOPICS)]}."
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ask}])
        reqs.append((name, tokenizer.encode(prompt)))
    return reqs


def build_engine(args, extra):
    from sgjax.engine.engine import Engine

    common = dict(
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        page_size=args.page_size,
        **extra,
    )
    if args.dummy:
        from sgjax.model.checkpoint import config_from_hf
        from sgjax.model.config import llama3_8b_config
        from sgjax.model.tokenizer import load_tokenizer
        from sgjax.model.weights import dummy_weights

        cfg = llama3_8b_config() if args.dummy == "llama3-8b" else config_from_hf(json.load(open(args.dummy)))
        key = (cfg,)
        if key not in _WEIGHTS:
            _WEIGHTS[key] = dummy_weights(cfg)
        return Engine.from_weights(cfg, _WEIGHTS[key], load_tokenizer(args.tokenizer_dir), **common)
    return Engine(args.model_path, **common)


_WEIGHTS: dict = {}


def check(value, schema) -> bool:
    """A small validator for the features SCHEMAS use (the GPU image has no jsonschema)."""
    try:
        import jsonschema

        jsonschema.validate(value, schema)
        return True
    except ImportError:
        pass
    except jsonschema.ValidationError:
        return False
    t = schema["type"]
    if t == "object":
        return (
            isinstance(value, dict)
            and set(schema["required"]) <= set(value) <= set(schema["properties"])
            and all(check(value[k], schema["properties"][k]) for k in value)
        )
    if t == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(check(v, schema["items"]) for v in value)
        )
    if t == "string":
        ok = isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
        if "enum" in schema:
            ok = ok and value in schema["enum"]
        if "pattern" in schema:
            ok = ok and re.fullmatch(schema["pattern"], value) is not None
        if schema.get("format") == "date":
            ok = ok and re.fullmatch(r"\d{4}-\d{2}-\d{2}", value) is not None
        return ok
    if t == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    if t == "boolean":
        return isinstance(value, bool)
    raise ValueError(f"check() does not know type {t}")


def run_config(args, name, extra, reqs):
    eng = build_engine(args, extra)
    params = [
        {"json_schema": json.dumps(SCHEMAS[s]), "max_new_tokens": args.max_new_tokens, "temperature": 0}
        for s, _ in reqs
    ]
    ids = [r for _, r in reqs]
    # Warm-up: the whole workload once, untimed, so the timed run compiles nothing (every bucket it meets was
    # met here) and finds the grammars cached (except for "rebuild", which compiles them again anyway).
    eng.generate(input_ids=ids, sampling_params=params)
    eng.flush_cache()
    before = eng.get_server_info()
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t0
    after = eng.get_server_info()
    eng.shutdown()
    invalid = 0
    for (schema, _), out in zip(reqs, outs):
        try:
            invalid += not check(json.loads(out["text"]), SCHEMAS[schema])
        except ValueError:
            invalid += 1
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    gc0, gc1 = before["grammar_cache"], after["grammar_cache"]
    return {
        "workload": "json",
        "config": name,
        "requests": len(reqs),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_per_s": tokens / wall,
        "programs_per_s": len(reqs) / wall,
        "steps": after["steps"] - before["steps"],
        "jump_forward_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
        "grammar_compiles": gc1["misses"] - gc0["misses"],
        "step_compiles": after["traces"] - before["traces"],
        "grammar_compile_s": gc1["compile_seconds"] - gc0["compile_seconds"],
        "invalid_outputs": invalid,
        "cache_hit_rate": (after["cached_tokens"] - before["cached_tokens"])
        / max(after["prompt_tokens"] - before["prompt_tokens"], 1),
        "sample_output": outs[0]["text"][:200],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dummy", default=None, help="llama3-8b (dummy weights; needs --tokenizer-dir)")
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--dump-tokenizer", default=None, help="write the default model's tokenizer as an HF dir and exit")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="/tmp/bench_json.jsonl")
    args = p.parse_args()

    from sgjax.model.tokenizer import load_tokenizer

    if args.dump_tokenizer:
        dump_tokenizer(args.dump_tokenizer)
        return
    tokenizer = load_tokenizer(args.tokenizer_dir or args.model_path)
    reqs = workload(tokenizer, args.num_requests)
    device = jax.devices()[0]
    rows = []
    for name in args.configs.split(","):
        row = run_config(args, name, CONFIGS[name], reqs)
        row.update(
            platform=device.platform,
            device=device.device_kind,
            model=args.dummy or "smollm2",
            command=" ".join(sys.argv),
        )
        rows.append(row)
        print(f"{name}: {row['wall_s']:.2f}s", flush=True)
        with open(args.out + ".partial", "a") as f:  # survives a timeout in a later configuration
            f.write(json.dumps(row) + "\n")
    base = next((r for r in rows if r["config"] == "no-jump"), rows[0])
    for r in rows:
        r["speedup_vs_no_jump"] = base["wall_s"] / r["wall_s"]
    print(
        f"\n{'config':<14}{'req':>5}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'steps':>7}{'jumped':>8}"
        f"{'compiles':>9}{'compile s':>10}{'invalid':>8}{'speedup':>9}"
    )
    for r in rows:
        print(
            f"{r['config']:<14}{r['requests']:>5}{r['output_tokens']:>8}{r['wall_s']:>9.2f}"
            f"{r['output_tok_per_s']:>9.1f}{r['steps']:>7}{r['jump_forward_tokens']:>8}{r['grammar_compiles']:>9}"
            f"{r['grammar_compile_s']:>10.2f}{r['invalid_outputs']:>8}{r['speedup_vs_no_jump']:>8.2f}x"
        )
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"\nwrote {args.out}")


def dump_tokenizer(path: str) -> None:
    """SmolLM2's tokenizer as an HF directory (tokenizer.json + config): the GPU image cannot read GGUF."""
    from sgjax.model.tokenizer import load_tokenizer, save_hf_dir

    save_hf_dir(load_tokenizer(None), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
