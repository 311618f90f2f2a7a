"""Weight sync for a training loop (engine/training.py): the time `Engine.update_weights` takes to serve new params,
and the memory it leaves behind, in three ways:

  aliased     a pytree already in the step's own layout and placement: served as it is (no copy)
  converted   the params as loaded (what a trainer holds): cast / packed / placed for the step (engine/loading.py
              run_weights), a new copy
  from disk   update_weights_from_disk: the checkpoint read again as at start

Each is run --repeat times on an idle engine (median), and a greedy request checks the engine still answers as it
did. Memory: the process's RSS on a CPU (the device is the host), the device's bytes in use on an accelerator, before
the first update and after the last (no second copy stays when the old weights have no other holder).

    python scripts/perf/bench_weight_sync.py                                   # SmolLM2 in float32, this CPU
    python scripts/perf/bench_weight_sync.py --model llama8b-dummy --save-dir /tmp/l8 --out $OUT/ws.jsonl   # a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama8b-dummy"])
    ap.add_argument("--dtype", default="float32", help="the engine's --dtype and --weight-dtype")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--save-dir",
        default=None,
        help="llama8b-dummy: write its weights here as an HF safetensors directory (in --dtype) and time from disk too",
    )
    ap.add_argument("--out", default=None, help="JSON lines (default /tmp/bench_weight_sync_<platform>.jsonl)")
    return ap.parse_args()


def memory_bytes() -> int:
    import jax

    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_in_use" in stats:
        return int(stats["bytes_in_use"])
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def save_hf(cfg, params, path: str) -> str:
    """The params as an HF safetensors directory in the config's dtype (what update_weights_from_disk reads)."""
    import jax.numpy as jnp
    import numpy as np
    from safetensors.numpy import save_file

    from sgjax.model.families import hf_config_dict
    from sgjax.model.weights import to_hf_state_dict

    os.makedirs(path, exist_ok=True)
    dtype = jnp.dtype(cfg.dtype)
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in to_hf_state_dict(cfg, params).items()}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f)
    return path


def main() -> None:
    import jax

    from sgjax.engine.engine import Engine
    from sgjax.engine.loading import run_weights
    from sgjax.model.loader import load_model
    from sgjax.model.paths import default_model_path

    args = parse()
    settings = dict(dtype=args.dtype, weight_dtype=args.dtype, max_total_tokens=4096, max_running_requests=8)
    if args.model == "smollm2":
        path = default_model_path()
        cfg, params = load_model(path, args.dtype)
        engine = Engine(path, **settings)
    else:
        from sgjax.model.config import llama3_8b_config
        from sgjax.model.weights import dummy_weights

        path = None
        cfg = llama3_8b_config(args.dtype)
        params = dummy_weights(cfg)
        if args.save_dir:
            path = save_hf(cfg, params, args.save_dir)
        engine = Engine.from_weights(cfg, params, None, **settings)
    probe = {"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8] * 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    want = engine.generate(**probe)[0]["output_ids"]
    served = run_weights(cfg, params, engine.plan)
    jax.block_until_ready(served)
    ways = {"aliased": lambda: engine.update_weights(served), "converted": lambda: engine.update_weights(params)}
    if path is not None:
        ways["from disk"] = lambda: engine.update_weights_from_disk(path)
    rows = []
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(served))
    gc.collect()
    before = memory_bytes()
    for way, update in ways.items():
        if way == "from disk":  # the trainer's copies go first: an 8B's third copy would not fit beside them
            params = served = None
            gc.collect()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            update()
            jax.block_until_ready(engine.runner.weights)
            times.append(time.perf_counter() - t0)
        same = engine.generate(**probe)[0]["output_ids"] == want
        gc.collect()
        rows.append({"workload": "weight_sync", "configuration": way, "seconds": statistics.median(times)})
        rows[-1].update(outputs_unchanged=same, memory_after_way=memory_bytes())
    gc.collect()
    after = memory_bytes()
    engine.shutdown()
    base = rows[0]["seconds"]
    for r in rows:
        r.update(
            model=args.model,
            dtype=args.dtype,
            platform=jax.devices()[0].platform,
            device=jax.devices()[0].device_kind,
            weight_bytes=weight_bytes,
            memory_before=before,
            memory_after=after,
            ratio_to_aliased=r["seconds"] / base if base else None,
            repeat=args.repeat,
        )
    print(f"\n{'way':10} {'seconds':>9} {'vs aliased':>10} {'same out':>8} {'memory +MiB':>11}")
    for r in rows:
        print(
            f"{r['configuration']:10} {r['seconds']:9.4f} {r['ratio_to_aliased']:10.1f} "
            f"{str(r['outputs_unchanged']):>8} {(r['memory_after_way'] - before) / 2**20:11.0f}"
        )
    print(
        f"weights {weight_bytes / 2**20:.0f} MiB; memory before the updates {before / 2**20:.0f} MiB, after "
        f"{after / 2**20:.0f} MiB ({(after - before) / 2**20:+.0f} MiB)"
    )
    out = args.out or f"/tmp/bench_weight_sync_{rows[0]['platform']}.jsonl"
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
