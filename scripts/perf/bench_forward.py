"""Forward-step time of a model on the GPU, against the roofline and HF transformers.

    python scripts/perf/bench_forward.py --out out/          # H200: dummy Llama-3-8B, bf16
    python scripts/perf/bench_forward.py --model qwen3-8b --out out/   # or gemma3-12b (sliding windows)
    python scripts/perf/bench_forward.py --model qwen3-30b-a3b --skip-hf --out out/   # or mixtral-8x7b (MoE)
    python scripts/perf/bench_forward.py --small --out out/  # CPU smoke run on a tiny config

Runs two child processes in turn (so neither framework holds GPU memory the other needs): `sgjax`
(our jitted step over the paged pool, per attention backend) and `hf` (transformers, same config and
dtype, dummy weights, DynamicCache). The copy bandwidth and the bf16 matmul rate are measured in the
sgjax child, and every row is reported against them. Writes JSON lines to OUT/bench_forward.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

WORKLOADS = [  # (name, batch, context, new tokens per request)
    ("decode", 1, 1024, 1),
    ("decode", 8, 1024, 1),
    ("decode", 32, 1024, 1),
    ("decode", 128, 1024, 1),
    ("prefill", 1, 4096, 4096),
]
# Speculative decoding's verify step: the last token and k drafted ones per request, against decode (k = 0)
VERIFY_WORKLOADS = [("verify", b, 1024, k + 1) for b in (1, 8, 32, 64) for k in (1, 2, 3, 4, 6, 8)]
DECODE_64 = ("decode", 64, 1024, 1)  # verify's 64-row baseline
# --variants: (weights, KV pool). fp8: e4m3 matrices widened to bf16 (w8a16); w8a8: activations e4m3 per token too
VARIANTS = {
    "bf16": (None, "bfloat16"),
    "fp8": ("fp8", "bfloat16"),
    "w8a8": ("w8a8_fp8", "bfloat16"),
    "fp8kv": (None, "float8_e4m3fn"),
    "fp8kv+scales": (None, "float8_e4m3fn"),  # with a scale per layer for K and V (model/kv_scales.py)
    "fp8block": ("fp8", "bfloat16"),  # a block-scaled checkpoint's matrices: scales per 128 columns of a row
    "w8a8+fp8kv": ("w8a8_fp8", "float8_e4m3fn"),
    "fp8+fp8kv": ("fp8", "float8_e4m3fn"),
}
SMALL_WORKLOADS = [("decode", 1, 64, 1), ("decode", 8, 64, 1), ("prefill", 1, 128, 128)]


def model_config(small: bool, model: str = "llama3-8b"):
    from sgjax.model.config import BENCH_CONFIGS, ModelConfig

    if small:  # the named model's family at a tiny size
        moe = (
            {
                "architecture": "qwen3_moe",
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "qk_norm": True,
            }
            if BENCH_CONFIGS[model]().is_moe
            else {"architecture": "llama"}
        )
        return ModelConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            dtype="bfloat16",
            **moe,
        )
    return BENCH_CONFIGS[model]("bfloat16")


def cost(
    cfg, batch: int, context: int, new: int, logit_rows: int | None = None, variant: str = "bf16"
) -> tuple[float, float]:
    """(bytes, flops) a step must move and compute at least. A mixture of experts reads only the experts its rows
    pick: with uniform routing (the dummy router is random) E * (1 - (1 - k/E)^rows) distinct experts per layer, and
    computes k experts per row. An fp8 variant's layer matrices (the embedding and head stay bf16) or pool are one
    byte an element."""
    itemsize = 2 if cfg.dtype == "bfloat16" else 4
    weights, kv = VARIANTS[variant]
    matrix_size = 1 if weights else itemsize
    kv_size = 1 if kv.startswith("float8") else itemsize
    rows = batch * new
    embed = cfg.vocab_size * cfg.hidden_size
    dense = cfg.num_params(active=True) - embed - (0 if cfg.tie_word_embeddings else embed)  # per-row matmul weights
    head = embed
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_size
    read = dense
    if cfg.is_moe:
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        read = dense + cfg.num_layers * expert * (e * (1 - (1 - k / e) ** rows) - k)
    bytes_moved = read * matrix_size + head * itemsize + batch * context * kv_per_token
    # Causal attention: row i of a request attends to (context - new + i + 1) keys; QK and PV are 2 flops each.
    keys = batch * (new * (context - new) + new * (new + 1) / 2)
    flops = (
        2 * dense * rows + 2 * head * (logit_rows or batch) + 4 * keys * cfg.num_heads * cfg.head_dim * cfg.num_layers
    )
    return bytes_moved, flops


def run_sgjax(args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, os.path.dirname(__file__))
    from roofline import copy_bandwidth, matmul_rate, roofline, time_fn

    from sgjax.engine.buckets import bucket
    from sgjax.kernels import allocate_pool, get_backend
    from sgjax.model import kv_scales
    from sgjax.model.batch import build_batch
    from sgjax.model.llama import XLA, XLA_W8A8, forward
    from sgjax.model.moe import experts
    from sgjax.model.quant import Fp8Matrix
    from sgjax.model.weights import cast_matrices, dummy_layer_weights, dummy_weights

    small = args.small
    bw = copy_bandwidth(1 << 26 if small else 4 << 30)
    rate = matmul_rate(512 if small else 8192)
    w8a8 = any(VARIANTS[v][0] == "w8a8_fp8" for v in args.variants)
    rate_fp8 = matmul_rate(512 if small else 8192, jnp.float8_e4m3fn) if w8a8 else None
    device = jax.devices()[0]
    rows = [
        {
            "kind": "ceiling",
            "copy_gb_per_s": bw / 1e9,
            "bf16_tflop_per_s": rate / 1e12,
            "fp8_tflop_per_s": rate_fp8 / 1e12 if rate_fp8 else None,
            "device": str(device.device_kind),
            "memory_bytes_limit": (device.memory_stats() or {}).get("bytes_limit"),
            "jax": jax.__version__,
        }
    ]
    cfg = model_config(small, args.model)
    platform = jax.devices()[0].platform

    # on an accelerator made layer by layer: Mixtral-8x7B's 93 GB would not fit twice (stacked, then sliced)
    def bf16_weights():  # made again for each variant (same seed): an 8B's bf16 and fp8 copies need not coexist
        return dummy_weights(cfg) if platform == "cpu" else dummy_layer_weights(cfg)

    page = 16
    workloads = SMALL_WORKLOADS if small else WORKLOADS + [DECODE_64] + VERIFY_WORKLOADS
    workloads = [
        w
        for w in workloads
        if (not args.workloads or w[0] in args.workloads) and (not args.batches or w[1] in args.batches)
    ]
    max_pages = max(b * -(-c // page) for _, b, c, _ in workloads) + 1
    first_logits = {}  # workload -> logits of the first backend, to compare the others against
    # "pallas:triton" / "pallas:mgpu": the pallas backend with that prefill kernel (kernels/pallas_gpu.py); a
    # mixture of experts runs each attention backend with each --moe-kernel
    moe_kernels = args.moe_kernel if cfg.is_moe else [None]
    runs = [(v, b, m) for v in args.variants for b in args.attention for m in moe_kernels]
    for variant, backend, moe_kernel in runs:
        quantization, kv_dtype = VARIANTS[variant]
        weights = None  # the last variant's go before this one's are made
        weights = cast_matrices(bf16_weights(), "fp8") if quantization else bf16_weights()
        if variant == "fp8block":  # the same e4m3 values, each row's scale repeated per 128 columns (grouped)
            weights = jax.tree.map(
                lambda m: (
                    Fp8Matrix(m.q, jnp.repeat(m.scale[..., None], max(1, m.q.shape[-1] // 128), axis=-1))
                    if isinstance(m, Fp8Matrix)
                    else m
                ),
                weights,
                is_leaf=lambda m: isinstance(m, Fp8Matrix),
            )
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(weights))
        ops = XLA_W8A8 if quantization == "w8a8_fp8" else XLA
        name_, _, prefill = backend.partition(":")
        attend = get_backend(name_)
        if prefill:
            attend = functools.partial(attend, prefill_kernel=prefill)
        if variant.endswith("+scales"):  # what --quantization-param-path adds: three scalings around attention
            per_layer = tuple(0.05 * (1 + i % 3) for i in range(cfg.num_layers))
            attend = kv_scales.scaled(attend, kv_scales.KvScales(per_layer, per_layer[::-1], "bench"))
        experts_fn = functools.partial(experts, activation=cfg.activation, kernel=moe_kernel) if moe_kernel else None
        step = jax.jit(
            functools.partial(forward, cfg=cfg, attention=attend, experts_fn=experts_fn, ops=ops),
            donate_argnames=("pool",),
        )
        impl = f"sgjax-{backend}" + (f"+moe-{moe_kernel}" if moe_kernel and moe_kernel != "xla" else "")
        pool = allocate_pool(cfg.num_layers, max_pages, page, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
        pool = jax.jit(
            lambda p: jax.random.normal(jax.random.PRNGKey(3), p.shape, jnp.bfloat16).astype(p.dtype),
            donate_argnums=0,
        )(pool)  # random, never zeros: zeros can run faster than real data
        kv_per_token = pool.nbytes // (pool.shape[1] * page)  # every layer's K and V
        state = {}
        for name, batch, context, new in workloads:
            pages_per_req = -(-context // page)
            tables = [list(range(1 + i * pages_per_req, 1 + (i + 1) * pages_per_req)) for i in range(batch)]
            chunks = [
                [int(t) for t in jax.random.randint(jax.random.PRNGKey(i), (new,), 0, cfg.vocab_size)]
                for i in range(batch)
            ]
            # verify: every row's logits, as a draft's rows need them; otherwise each request's last row
            every = name == "verify"
            logits_rows = [i * new + j for i in range(batch) for j in range(new)] if every else None
            host = build_batch(
                chunks,
                [context] * batch,
                tables,
                page,
                bucket(batch * new, 16),
                bucket(batch, 1),
                pages_per_req,
                **({"logits_rows": logits_rows, "num_logits": bucket(len(logits_rows), 16)} if every else {}),
            )
            dev = jax.tree.map(jnp.asarray, host)
            state["pool"] = pool

            def call():
                logits, state["pool"] = step(weights, state["pool"], dev)
                return logits

            logits = np.asarray(call(), np.float32)  # one step on the fresh pool: the same input for every backend
            key = (name, batch, context, new)
            first_logits.setdefault(key, logits)
            err = float(np.linalg.norm(logits - first_logits[key]) / np.linalg.norm(first_logits[key]))
            seconds = time_fn(call, warmup=2, iters=5 if name == "prefill" else 20)
            pool = state["pool"]
            nbytes, flops = cost(cfg, batch, context, new, batch * new if name == "verify" else batch, variant)
            rows.append(
                {
                    "kind": "step",
                    "impl": impl,
                    "variant": variant,
                    "workload": name,
                    "batch": batch,
                    "context": context,
                    "tokens": batch * new,
                    "weight_bytes": weight_bytes,
                    "kv_bytes_per_token": kv_per_token,
                    "logits_rel_err_vs_first_backend": err,
                    **roofline(seconds, nbytes, flops, bw, rate_fp8 if ops is XLA_W8A8 else rate),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        state.clear()  # it held the last pool too: two pools of 17 GB ran an H100 out of memory
        del pool
    return rows


def run_hf(args):
    import time

    import torch
    import transformers

    from sgjax.model.families import hf_config_dict

    cfg = model_config(args.small, args.model)
    d = hf_config_dict(cfg)
    hc = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, d["architectures"][0])(hc).to(torch.bfloat16).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    workloads = SMALL_WORKLOADS if args.small else WORKLOADS
    with torch.no_grad():
        for name, batch, context, new in workloads:
            ids = torch.randint(0, cfg.vocab_size, (batch, context), device=device)
            times = []
            if name == "prefill":
                for i in range(7):
                    sync()
                    t = time.perf_counter()
                    model(ids, use_cache=False, logits_to_keep=1)
                    sync()
                    times.append(time.perf_counter() - t)
            else:
                out = model(ids[:, :-1], use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                for i in range(22):
                    sync()
                    t = time.perf_counter()
                    model(ids[:, -1:], past_key_values=cache, use_cache=True)
                    sync()
                    times.append(time.perf_counter() - t)
                    cache.crop(-1)  # drop the token just appended: the context stays fixed across repetitions
                del cache, out
            seconds = sorted(times[2:])[len(times[2:]) // 2]
            rows.append(
                {
                    "kind": "step",
                    "impl": "hf-transformers",
                    "workload": name,
                    "batch": batch,
                    "context": context,
                    "tokens": batch * new,
                    "seconds": seconds,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny config (CPU smoke run)")
    from sgjax.model.config import BENCH_CONFIGS

    parser.add_argument(
        "--model",
        default="llama3-8b",
        choices=sorted(BENCH_CONFIGS),
        help="dummy-weight shapes (sgjax.model.config.BENCH_CONFIGS; mixtral-8x7b and qwen3-30b-a3b "
        "are mixtures of experts)",
    )
    parser.add_argument("--out", default="out")
    parser.add_argument("--attention", nargs="+", default=["ref"], help="attention backends to time")
    parser.add_argument(
        "--moe-kernel",
        nargs="+",
        default=["xla"],
        choices=["xla", "pallas"],
        help="a mixture of experts' grouped matmuls: xla (ragged_dot) and/or pallas (kernels/grouped_matmul_gpu.py)",
    )
    parser.add_argument("--part", choices=["sgjax", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--workloads", nargs="*", default=[], help="only these workloads (decode, prefill, verify)")
    parser.add_argument("--batches", nargs="*", type=int, default=[], help="only these batch sizes")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["bf16"],
        choices=sorted(VARIANTS),
        help="weights and pool: bf16, fp8 (w8a16), w8a8 (fp8 activations per token too), fp8kv (e4m3 pool), ...",
    )
    parser.add_argument("--tag", default=None, help="a label copied into every row (e.g. the XLA_FLAGS tried)")
    args = parser.parse_args()
    if args.part:
        rows = run_sgjax(args) if args.part == "sgjax" else run_hf(args)
        with open(os.path.join(args.out, f"part_{args.part}.json"), "w") as f:
            json.dump(rows, f)
        return
    os.makedirs(args.out, exist_ok=True)
    base = (
        [
            sys.executable,
            __file__,
            "--out",
            args.out,
            "--model",
            args.model,
            "--attention",
            *args.attention,
            "--moe-kernel",
            *args.moe_kernel,
            "--variants",
            *args.variants,
        ]
        + (["--small"] * args.small)
        + (["--workloads", *args.workloads] if args.workloads else [])
        + (["--batches", *map(str, args.batches)] if args.batches else [])
    )
    subprocess.run(base + ["--part", "sgjax"], check=True)
    rows = json.load(open(os.path.join(args.out, "part_sgjax.json")))
    if not args.skip_hf:
        subprocess.run(base + ["--part", "hf"], check=True)
        rows += json.load(open(os.path.join(args.out, "part_hf.json")))
    report(rows, args)


def report(rows, args):
    sys.path.insert(0, os.path.dirname(__file__))
    from roofline import roofline

    ceiling = rows[0]
    bw, rate = ceiling["copy_gb_per_s"] * 1e9, ceiling["bf16_tflop_per_s"] * 1e12
    cfg = model_config(args.small, args.model)
    steps = [r for r in rows if r["kind"] == "step"]
    for r in steps:
        if "seconds" in r:
            r.update(
                roofline(
                    r.pop("seconds"),
                    *cost(cfg, r["batch"], r["context"], r["tokens"] // r["batch"]),
                    bw,
                    rate,
                )
            )
    hf = {(r["workload"], r["batch"], r["context"]): r["ms"] for r in steps if r["impl"] == "hf-transformers"}
    ours = {(r["impl"], r.get("variant"), r["workload"], r["batch"], r["tokens"]): r["ms"] for r in steps}
    for r in steps:  # the baselines of the same run: bf16 for a variant, the decode step for a verify step
        if r["impl"] != "hf-transformers":
            bf16 = ours.get((r["impl"], "bf16", r["workload"], r["batch"], r["tokens"]))
            r["speedup_vs_bf16"] = bf16 / r["ms"] if bf16 else None
            decode = ours.get((r["impl"], r.get("variant"), "decode", r["batch"], r["batch"]))
            r["cost_vs_decode"] = r["ms"] / decode if decode and r["workload"] == "verify" else None
    print(
        f"\n{ceiling['device']}, jax {ceiling['jax']}: copy {ceiling['copy_gb_per_s']:.0f} GB/s, "
        f"bf16 matmul {ceiling['bf16_tflop_per_s']:.0f} TFLOP/s; model {cfg.num_params() / 1e9:.2f}B params bf16"
    )
    print("logit err: |logits - first backend's| / |first backend's| on the same first step (sgjax rows only)")
    print(
        f"{'impl':18} {'variant':11} {'workload':8} {'batch':>5} {'tok':>5} {'ctx':>5} {'ms':>9} {'GB/s':>7} "
        f"{'bw%':>5} {'TFLOP/s':>8} {'mm%':>5} {'roof%':>6} {'vs HF':>6} {'vs bf16':>7} {'/decode':>7} {'logit err':>9}"
    )
    ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
    with open(os.path.join(args.out, "bench_forward.jsonl"), "a") as f:
        for r in steps:
            key = (r["workload"], r["batch"], r["context"])
            r["speedup_vs_hf"] = hf[key] / r["ms"] if key in hf else None
            r["config"] = f"dummy-{args.model}-{r.get('variant', 'bf16')}" if not args.small else "tiny-bf16"
            r["tag"] = args.tag
            r["xla_flags"] = os.environ.get("XLA_FLAGS", "")
            f.write(json.dumps({**r, "ceiling": ceiling}) + "\n")
            print(
                f"{r['impl']:18} {r.get('variant', '-'):11} {r['workload']:8} {r['batch']:5d} {r['tokens']:5d} "
                f"{r['context']:5d} {r['ms']:9.2f} {r['gb_per_s']:7.0f} {100 * r['bw_ratio']:5.1f} "
                f"{r['tflop_per_s']:8.1f} {100 * r['flop_ratio']:5.1f} {100 * r['roofline_ratio']:6.1f} "
                f"{ratio(r['speedup_vs_hf']):>6} {ratio(r.get('speedup_vs_bf16')):>7} "
                f"{ratio(r.get('cost_vs_decode')):>7} {r.get('logits_rel_err_vs_first_backend', 0.0):9.1e}"
            )


if __name__ == "__main__":
    main()
