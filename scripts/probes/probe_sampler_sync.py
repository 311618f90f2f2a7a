"""Does the sampler's lax.cond make a step's dispatch wait for the device? And what do its optional parts cost?

A stand-in for one decode step: a chain of bf16 matmuls (the forward, ~`--busy-ms` on the device) ending in
float32 logits [rows, vocab], then the engine's sampler, jitted as one program. Times, per variant, how long the
jitted call takes to return (dispatch) and to finish:
  device  - Branches() : the optional parts behind lax.conds on device predicates (the CPU's way)
  static  - Branches(draws=True, filters=False): no device predicate (an accelerator's step)
  static+filters - the same with the filters' sort compiled in
and, alone on device-resident logits, the cost of each optional part (Gumbel noise, the filters, top-k 20).
One JSON object per line to --out."""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.engine.sampler import Branches, default_rows, pack_sampling, sample, unpack_sampling


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=64, help="matmuls in the stand-in forward")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="/tmp/probe_sampler_sync.jsonl")
    args = ap.parse_args()
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (args.layers, args.hidden, args.hidden), jnp.bfloat16) * (args.hidden ** -0.5)
    head = jax.random.normal(key, (args.hidden, args.vocab), jnp.bfloat16) * (args.hidden ** -0.5)
    h0 = jax.random.normal(key, (args.rows, args.hidden), jnp.bfloat16)
    rows = default_rows(args.rows, 0)
    rows["temperature"][::2] = 0.8  # half the rows sample, so the draw is live
    buffer = jnp.asarray(pack_sampling(rows))

    def forward(h, w, head):  # weights as arguments: captured, they would be compiled in as constants
        def layer(h, wi):
            return jnp.tanh(h @ wi), None
        h, _ = jax.lax.scan(layer, h, w)
        return (h @ head).astype(jnp.float32)

    def make(branches):
        @jax.jit
        def step(h, buf, w, head):
            batch = unpack_sampling(buf, args.rows, 0)
            return sample(forward(h, w, head), batch, num_top_logprobs=0, branches=branches).tokens
        return lambda h, buf: step(h, buf, w, head)

    out = []

    def record(row):
        row = {"tag": args.tag, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows,
               "vocab": args.vocab, **row}
        out.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:  # row by row: a run cut short keeps what it measured
            f.write(json.dumps(row) + "\n")

    print(f"start: {jax.devices()[0].device_kind}", flush=True)
    fwd = jax.jit(forward)
    jax.block_until_ready(fwd(h0, w, head))
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        r = fwd(h0, w, head)
    jax.block_until_ready(r)
    record({"case": "forward alone", "total_ms": 1e3 * (time.perf_counter() - t0) / args.repeats})
    variants = {"device": Branches(), "static": Branches(draws=True, filters=False),
                "static+filters": Branches(draws=True, filters=True)}
    for name, branches in variants.items():
        fn = make(branches)
        jax.block_until_ready(fn(h0, buffer))
        calls, totals = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = fn(h0, buffer)
            t1 = time.perf_counter()
            jax.block_until_ready(r)
            t2 = time.perf_counter()
            calls.append(t1 - t0)
            totals.append(t2 - t0)
        # back to back: the steady throughput when nothing waits on the host between calls
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            r = fn(h0, buffer)
        jax.block_until_ready(r)
        record({"case": name, "call_ms": 1e3 * float(np.median(calls)), "total_ms": 1e3 * float(np.median(totals)),
                "back_to_back_ms": 1e3 * (time.perf_counter() - t0) / args.repeats})
    logits = jax.random.normal(key, (args.rows, args.vocab), jnp.float32) * 3
    batch = unpack_sampling(buffer, args.rows, 0)
    parts = {
        "sampler greedy (no parts)": lambda x: sample(x, batch, branches=Branches(draws=False, filters=False)).tokens,
        "sampler + gumbel": lambda x: sample(x, batch, branches=Branches(draws=True, filters=False)).tokens,
        "sampler + gumbel + filters": lambda x: sample(x, batch, branches=Branches(draws=True, filters=True)).tokens,
        "sampler + top-20 logprobs": lambda x: sample(x, batch, num_top_logprobs=20,
                                                      branches=Branches(draws=False, filters=False)).top_ids,
    }
    for name, fn in parts.items():
        fn = jax.jit(fn)
        jax.block_until_ready(fn(logits))
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            r = fn(logits)
        jax.block_until_ready(r)
        record({"case": name, "total_ms": 1e3 * (time.perf_counter() - t0) / args.repeats})


if __name__ == "__main__":
    main()
