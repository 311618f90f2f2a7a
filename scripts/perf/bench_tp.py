"""Tensor parallelism's step time and memory per device: the jitted step (engine/runner.py) at TP=1/2/4.

Per TP size (with --shard-vocab, also TP>1 with the embedding and lm_head vocab-sharded; with --ep and a mixture of
experts, also TP>1 with expert parallelism, ep = tp: whole experts per device): the weights placed on a
(data=1, tensor=N) mesh (engine/mesh.py), a KV pool of --pool-tokens, then two step shapes timed on the runner's
dummy buffer (`Runner.run_dummy`: the compiled program of that shape, every padded row computed):

  decode    --decode-batch requests of one token each, the page table --context tokens wide
  prefill   --prefill-tokens tokens of 4 requests

Each shape is compiled and run once, then timed --steps times (median). Columns: ms per step, tokens/s, ratio to
TP=1 of the same run, and the bytes of weights and pool on the fullest device.

On CPU the devices are host "devices" sharing the same cores (--devices sets jax_num_cpu_devices), so the numbers
are plumbing (the collectives' and shard_map's overhead), not a speed-up. On a GPU host:

    python scripts/perf/bench_tp.py --model llama8b-dummy --tp 1,2 --out $OUT/bench_tp.jsonl
    python scripts/perf/bench_tp.py --model mixtral-8x7b --tp 2,4 --ep --out $OUT/bench_tp_moe.jsonl  # MoE, sharded
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "tiny-moe", "small", "llama8b-dummy", "mixtral-8x7b", "qwen3-30b-a3b"],
        help="tiny: TINY_SMOLLM2_VOCAB; tiny-moe: a 2-layer Qwen3-MoE of 8 experts; small: a 4-layer "
        "512-wide Llama; llama8b-dummy, mixtral-8x7b, qwen3-30b-a3b: random weights of those shapes "
        "(bf16)",
    )
    ap.add_argument("--tp", default="1,2,4", help="comma-separated TP sizes")
    ap.add_argument("--devices", type=int, default=4, help="CPU host devices (CPU only)")
    ap.add_argument("--shard-vocab", action="store_true", help="also time TP>1 with a vocab-sharded embed/lm_head")
    ap.add_argument("--ep", action="store_true", help="a mixture of experts: also time TP>1 with ep_size = tp")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512, help="page-table width of the decode step, in tokens")
    ap.add_argument("--prefill-tokens", type=int, default=256)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON lines (default /tmp/bench_tp_<platform>.jsonl)")
    return ap.parse_args()


def model(name: str):
    import jax

    from sgjax.model.config import BENCH_CONFIGS, ModelConfig, llama3_8b_config
    from sgjax.model.presets import TINY_SMOLLM2_VOCAB

    if name == "tiny":
        return TINY_SMOLLM2_VOCAB
    if name == "tiny-moe":
        return ModelConfig(
            architecture="qwen3_moe",
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            qk_norm=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        )
    if name in BENCH_CONFIGS:
        return BENCH_CONFIGS[name]("bfloat16")
    if name == "small":
        dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
        return ModelConfig(
            architecture="llama",
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            max_position_embeddings=4096,
            dtype=dtype,
        )
    return llama3_8b_config("bfloat16")


def run_one(cfg, tp_size: int, shard_vocab: bool, ep_size: int, args):
    import jax

    from sgjax.engine import mesh as tp
    from sgjax.engine.args import ServerArgs
    from sgjax.engine.loading import run_weights
    from sgjax.engine.plan import Machine, resolve
    from sgjax.engine.runner import Runner
    from sgjax.engine.step import StepShape
    from sgjax.model.batch import BatchShape
    from sgjax.model.weights import dummy_weights

    mesh = tp.make_mesh(tp_size) if tp_size > 1 else None
    tp.check_model(cfg, tp_size, ep_size)
    plan = resolve(
        ServerArgs(tp_size=tp_size, ep_size=ep_size, step_buckets="fine"), cfg, Machine.here(), given=cfg.dtype
    )
    if mesh is None:
        weights = run_weights(cfg, dummy_weights(cfg), plan)
    else:
        weights = run_weights(
            cfg, tp.dummy_weights(cfg, mesh, shard_vocab=shard_vocab, expert_parallel=plan.expert_parallel), plan, mesh
        )
    runner = Runner(
        tp.tp_config(cfg, tp_size),
        weights,
        plan,
        num_pages=1 + args.pool_tokens // args.page_size,
        page_size=args.page_size,
        max_context=max(args.context, args.prefill_tokens),
        max_top_logprobs=0,
        max_reqs=max(args.decode_batch, 4),
        mesh=mesh,
    )
    width = -(-args.context // args.page_size)
    r = args.decode_batch
    shapes = {
        "decode": (StepShape(BatchShape(max(16, r), r, width, r), 0, 0), r),
        "prefill": (
            StepShape(BatchShape(args.prefill_tokens, 4, -(-args.prefill_tokens // args.page_size), 4), 0, 0),
            args.prefill_tokens,
        ),
    }
    out = {}
    for workload, (shape, tokens) in shapes.items():
        jax.block_until_ready(runner.run_dummy(shape))  # compile + first run
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.run_dummy(shape))
            times.append(time.perf_counter() - t0)
        out[workload] = statistics.median(times), tokens
    wbytes = max(tp.addressable_bytes(runner.weights).values())
    pbytes = max(tp.addressable_bytes(runner.state.pool).values())
    state_ok = mesh is None or runner.state.pool.sharding.is_equivalent_to(tp.pool_sharding(mesh), 5)
    return out, wbytes, pbytes, state_ok, runner.traces


def main():
    args = parse()
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts; only the CPU's count
    cfg = model(args.model)
    platform = jax.devices()[0].platform
    configs = [(t, False, 1) for t in map(int, args.tp.split(","))]
    if args.shard_vocab:
        configs += [(t, True, 1) for t, _, _ in configs if t > 1]
    if args.ep:
        configs += [(t, False, t) for t, v, _ in configs if t > 1 and not v]
    rows, base = [], {}
    for tp_size, shard_vocab, ep_size in configs:
        res, wbytes, pbytes, state_ok, traces = run_one(cfg, tp_size, shard_vocab, ep_size, args)
        label = f"tp{tp_size}" + ("-vocab" if shard_vocab else "") + (f"-ep{ep_size}" if ep_size > 1 else "")
        for workload, (sec, tokens) in res.items():
            base.setdefault(workload, sec if tp_size == 1 else None)
            ratio = base[workload] / sec if base.get(workload) else None
            rows.append(
                dict(
                    bench="bench_tp",
                    workload=workload,
                    model=args.model,
                    platform=platform,
                    configuration=label,
                    tp_size=tp_size,
                    shard_vocab=shard_vocab,
                    ep_size=ep_size,
                    latency_ms=sec * 1e3,
                    throughput_tok_s=tokens / sec,
                    ratio_to_tp1=ratio,
                    weight_bytes_per_device=wbytes,
                    pool_bytes_per_device=pbytes,
                    state_sharding_kept=state_ok,
                    compiles=traces,
                )
            )
    print(
        f"{'workload':8} {'config':10} {'ms/step':>9} {'tok/s':>10} {'x tp1':>6} {'weights/dev':>12} {'pool/dev':>10}"
    )
    for r in rows:
        ratio = "" if r["ratio_to_tp1"] is None else f"{r['ratio_to_tp1']:.2f}"
        print(
            f"{r['workload']:8} {r['configuration']:10} {r['latency_ms']:9.2f} {r['throughput_tok_s']:10.0f} "
            f"{ratio:>6} {r['weight_bytes_per_device'] / 2**20:10.1f}Mi {r['pool_bytes_per_device'] / 2**20:8.1f}Mi"
        )
    out = args.out or f"/tmp/bench_tp_{platform}.jsonl"
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
