"""Benchmark the FSM: grammar compile time (cache miss/hit), table sizes, forward passes saved by
jump-forward under a deterministic fake model, and the jitted mask + advance step for a batch.

    .venv/bin/python scripts/perf/bench_fsm.py [--out out/bench_fsm.jsonl] [--batch 1 64] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

PAPER_REGEX = r'\{"summary": "[\w\d\s]+\.", "grade": "[ABCD][+-]?"\}'
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 20},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["id", "name", "email", "role", "active", "score", "tags", "address"],
}


def fake_model(vocab, seed: int):
    """Seeded random logits that favour closing tokens, so strings and objects end in a few dozen tokens."""
    closing = np.array([bool(t) and any(c in t for c in b'"]}.') for t in vocab.tokens]) * 6.0
    closing[min(vocab.eos_ids)] += 4.0

    def logits(tokens):
        return (
            np.random.default_rng(hash((seed, len(tokens), tuple(tokens[-4:]))) % 2**32).normal(size=vocab.size)
            + closing
        )

    return logits


def bench_step(grammars, vocab_size: int, batch: int, iters: int) -> dict:
    import jax
    import jax.numpy as jnp

    from sgjax.fsm import advance, apply_mask, pack_tables

    tables, offsets = pack_tables(grammars, vocab_size)

    @jax.jit
    def step(tables, states, logits):
        masked = apply_mask(logits, tables, states)
        tokens = jnp.argmax(masked, axis=-1).astype(jnp.int32)
        return tokens, advance(tables, states, tokens)

    @jax.jit
    def baseline(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    rng = np.random.default_rng(0)
    states = jnp.asarray(rng.choice(np.arange(offsets[0], tables.num_states), size=batch).astype(np.int32))
    logits = jnp.asarray(rng.normal(size=(batch, vocab_size)).astype(np.float32))
    out = {}
    for name, fn, args in (("masked_step", step, (tables, states, logits)), ("argmax_only", baseline, (logits,))):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        out[name + "_us"] = float(np.median(times) * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/bench_fsm.jsonl")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2)")
    args = ap.parse_args()

    from sgjax.fsm import GrammarCache, JsonOptions
    from sgjax.fsm.reference import greedy_decode
    from sgjax.fsm.vocab import load_vocabulary

    rows = []
    t0 = time.perf_counter()
    vocab = load_vocabulary(args.model)
    vocab.byte_matrix, vocab.sorted_index  # noqa: B018 - one-time per tokenizer, timed here
    rows.append({"bench": "vocab_load", "seconds": time.perf_counter() - t0, "vocab": vocab.size})

    cache = GrammarCache()
    cases = [
        ("paper_regex", lambda: cache.get_regex(PAPER_REGEX, vocab)),
        ("schema_fixed", lambda: cache.get_json_schema(SCHEMA, vocab)),
        ("schema_flexible", lambda: cache.get_json_schema(SCHEMA, vocab, JsonOptions(whitespace="[ \n]?"))),
    ]
    grammars = []
    for name, get in cases:
        t0 = time.perf_counter()
        g = get()
        miss = time.perf_counter() - t0
        t0 = time.perf_counter()
        get()
        hit = time.perf_counter() - t0
        plain, plain_fw = greedy_decode(g, fake_model(vocab, 1), use_jump=False)
        jumped, jump_fw = greedy_decode(g, fake_model(vocab, 1), use_jump=True)
        assert plain == jumped, "jump-forward changed the greedy output"
        grammars.append(g)
        rows.append(
            {
                "bench": "compile",
                "grammar": name,
                "miss_s": miss,
                "hit_s": hit,
                "states": g.num_states,
                "classes": g.tables.num_classes,
                "table_mb": g.nbytes / 1e6,
                "tokens": len(plain),
                "forwards_plain": plain_fw,
                "forwards_jump": jump_fw,
                "forward_ratio": plain_fw / max(jump_fw, 1),
            }
        )
    for batch in args.batch:
        rows.append(
            {
                "bench": "device_step",
                "batch": batch,
                "grammars": len(grammars),
                **bench_step(grammars, vocab.size, batch, args.iters),
            }
        )

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
