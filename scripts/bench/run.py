"""The paper's benchmark programs on sgjax, with the Figure 8c ablations and an HF transformers baseline.

    python scripts/bench/run.py --quick                      # every workload, small sizes (CI smoke test)
    python scripts/bench/run.py --workloads mmlu,hellaswag --num-programs 64
    python scripts/bench/run.py --dummy llama3-8b --tokenizer DIR --baseline none   # GPU throughput runs
    python scripts/bench/run.py --quick --dummy tiny         # tiny random weights, SmolLM2's tokenizer (CI smoke test)

For each workload and configuration a fresh engine (same weights, same pool) runs the batch with many frontend
threads (throughput) and then a few programs one at a time (latency). The baseline runs the same programs one
call at a time on HF transformers (torch), without any cache. Rows go to a JSON lines file, plots to PNGs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

WORKLOADS = (
    "mmlu",
    "hellaswag",
    "tree_of_thought",
    "skeleton_of_thought",
    "llm_judge",
    "json_decode",
    "multi_turn_short",
    "multi_turn_long",
    "react",
    "rag",
)

# The smoke test's ablation: the cache; the full runs add the rest of Figure 8c.
QUICK_CONFIGS = "full,no_cache"
# --dummy shapes: Llama-3-8B (GPU throughput runs), or TINY_SMOLLM2_VOCAB of sgjax/model/presets.py (the CI smoke test)
DUMMY = ("llama3-8b", "tiny")


# workload -> (module, program, score function or None): what a dumped workload file needs besides its data
PROGRAMS = {
    "mmlu": ("mmlu", "few_shot_mmlu", "score"),
    "hellaswag": ("hellaswag", "few_shot_hellaswag", "score"),
    "tree_of_thought": ("tree_of_thought", "tree_search", "score"),
    "skeleton_of_thought": ("skeleton_of_thought", "skeleton_of_thought", None),
    "llm_judge": ("llm_judge", "multi_dimension_judge", None),
    "json_decode": ("json_decode", "json_extract", "score"),
    "multi_turn_short": ("multi_turn_chat", "multi_turn", None),
    "multi_turn_long": ("multi_turn_chat", "multi_turn", None),
    "react": ("react", "react_agent", "contains_gold"),
    "rag": ("rag", "rag", "contains_gold"),
}


def build_workload(name: str, n: int, quick: bool):
    if name.startswith("multi_turn"):
        return importlib.import_module("multi_turn_chat").build(n, quick, long=name.endswith("long"))
    return importlib.import_module(name).build(n, quick)


def load_workload(entry: dict):
    """A workload from a --dump-workloads file: its data from the file, its program and score from the module."""
    from workload import Workload

    module_name, program, score = PROGRAMS[entry["name"]]
    module = importlib.import_module(module_name)
    return Workload(
        entry["name"],
        getattr(module, program),
        entry["arguments"],
        entry["labels"],
        getattr(module, score) if score else None,
        entry["description"],
    )


class EngineRunner:
    """One configuration of sgjax: an engine with the config's server args and the frontend switches."""

    def __init__(self, make_engine, config: harness.Config, threads: int, gen_cap: int | None = None):
        import sgjax.lang.global_config as gc
        from sgjax.lang.backend.engine import EngineBackend

        self.engine = make_engine(**config.engine)
        self.backend = EngineBackend(self.engine)
        if gen_cap:
            self.backend.generate = _capped(self.backend.generate, gen_cap)
            self.backend.generate_stream = _capped(self.backend.generate_stream, gen_cap)
        self.config, self.threads, self.gc = config, threads, gc.global_config
        self.page_size = self.engine.args.page_size

    def run_batch(self, program, arguments, threads):
        self.gc.enable_frontend_hint = self.config.hint
        self.gc.enable_parallelism = self.config.parallel
        return program.run_batch(
            arguments, backend=self.backend, num_threads=min(threads, self.threads) if self.config.parallel else 1
        )

    def reset(self):
        self.engine.flush_cache()
        self.engine.request_log = []

    def counters(self):
        return self.engine.get_server_info()

    def requests(self):
        """(prompt, output) token lists of every request the engine was given since reset()."""
        return [(r.input_ids, r.output_ids) for r in self.engine.request_log or []]

    def close(self):
        self.engine.check_invariants()
        self.engine.shutdown()
        self.engine = self.backend = None
        gc.collect()  # the next config's engine allocates its own pool: free this one first
        self.gc.enable_frontend_hint = True
        self.gc.enable_parallelism = True


def _capped(generate, cap: int):
    """A backend call with max_new_tokens at most `cap` (--gen-cap: shorter runs, the same for every config)."""

    def call(text, params):
        return generate(text, {**params, "max_new_tokens": min(params.get("max_new_tokens", 128), cap)})

    return call


class BaselineRunner:
    page_size = 1

    def __init__(self, backend):
        self.backend = backend

    def run_batch(self, program, arguments, threads):
        return program.run_batch(arguments, backend=self.backend, num_threads=1)  # one call at a time

    def reset(self):
        pass

    def counters(self):
        return None

    def requests(self):
        return []

    def close(self):
        pass


def engine_factory(args):
    """make_engine(**server_args) over weights loaded once, and what the HF baseline loads: the model path, or
    (config, weights, tokenizer) of --dummy weights, which HF then gets a copy of."""
    from sgjax.engine.engine import Engine

    common = {
        "max_running_requests": args.max_running_requests,
        "max_total_tokens": args.max_total_tokens,
        "page_size": args.page_size,
        "attention_backend": args.attention_backend,
    }
    common = {k: v for k, v in common.items() if v is not None}
    if args.dummy:
        from sgjax.model.config import llama3_8b_config
        from sgjax.model.presets import TINY_SMOLLM2_VOCAB
        from sgjax.model.tokenizer import load_tokenizer
        from sgjax.model.weights import dummy_weights

        if args.dummy not in DUMMY:
            raise SystemExit(f"unknown --dummy {args.dummy!r}; known: {', '.join(DUMMY)}")
        tok = load_tokenizer(args.tokenizer)
        # The shapes with the tokenizer's vocabulary, so every sampled id decodes to text. `tiny` (2 layers, hidden
        # 64) is the CI smoke test's: the harness, the cache and the HF baseline end to end in seconds.
        if args.dummy == "tiny":
            cfg = TINY_SMOLLM2_VOCAB.replace(dtype=args.dtype or "float32")
        else:
            cfg = llama3_8b_config(args.dtype or "bfloat16")
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size)
        weights = dummy_weights(cfg)
        return (lambda **kw: Engine.from_weights(cfg, weights, tok, **common, **kw)), (cfg, weights, tok)
    from sgjax.model.paths import default_model_path

    path = args.model_path or default_model_path()
    return (lambda **kw: Engine(path, **common, **kw)), path


def main() -> None:
    t_launch = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: every workload in a few minutes on 2 CPUs")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated of {', '.join({**harness.CONFIGS, **harness.EXTRA_CONFIGS})} (default: "
        f"the paper's {len(harness.CONFIGS)}; --quick: {QUICK_CONFIGS})",
    )
    ap.add_argument("--baseline", default="hf", help="hf (transformers, one call at a time) or none")
    ap.add_argument("--hf-device", default="cpu", help="torch device of the HF baseline (cpu, cuda)")
    ap.add_argument("--num-programs", type=int, default=None, help="programs per workload (default 2 quick, 64)")
    ap.add_argument("--latency-programs", type=int, default=None, help="run one at a time (default 0 quick, 8)")
    ap.add_argument(
        "--gen-cap",
        type=int,
        default=None,
        help="cap every gen's max_new_tokens (all sgjax configs alike; shorter GPU runs)",
    )
    ap.add_argument("--threads", type=int, default=64, help="frontend threads for the batch runs")
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed batch runs per configuration (cold cache each); the median counts"
    )
    ap.add_argument("--model-path", default=None, help="GGUF or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--dummy", default=None, help=f"{' | '.join(DUMMY)}: random weights with --tokenizer's vocabulary")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory or GGUF for --dummy (default: SmolLM2's)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--attention-backend", default=None, help="ref | pallas | pallas:triton | pallas:mgpu")
    ap.add_argument(
        "--dump-workloads",
        default=None,
        help="build the workloads, write their data to this JSON file and exit (for machines without the datasets)",
    )
    ap.add_argument("--workload-file", default=None, help="run the workloads of a --dump-workloads file")
    ap.add_argument("--out", default="/tmp/bench_programs.jsonl", help="JSON lines (appended)")
    ap.add_argument("--plots", default=None, help="directory for the PNG figures (default: next to --out)")
    ap.add_argument("--plot-only", default=None, help="draw the figures of this JSON lines file and exit")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            write_plots(
                [json.loads(line) for line in f], args.plots or os.path.dirname(os.path.abspath(args.plot_only))
            )
        return
    n = args.num_programs or (2 if args.quick else 64)
    latency_n = args.latency_programs if args.latency_programs is not None else (0 if args.quick else 8)
    names = [w for w in args.workloads.split(",") if w]
    config_names = args.configs or (QUICK_CONFIGS if args.quick else ",".join(harness.CONFIGS))
    known = {**harness.CONFIGS, **harness.EXTRA_CONFIGS}
    unknown = [c for c in config_names.split(",") if c and c not in known]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {', '.join(known)}")
    configs = [known[c] for c in config_names.split(",") if c]
    for w in names:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])
    if args.dump_workloads:
        with open(args.dump_workloads, "w") as f:
            json.dump({"command": command, "workloads": [build_workload(w, n, args.quick).to_json() for w in names]}, f)
        print(f"wrote {len(names)} workloads to {args.dump_workloads}")
        return
    stored = {}
    if args.workload_file:
        with open(args.workload_file) as f:
            stored = {e["name"]: e for e in json.load(f)["workloads"]}
    make_engine, hf_source = engine_factory(args)
    baseline = None
    if args.baseline == "hf":
        import torch
        from hf_backend import HFBackend, hf_model_from_weights, load_hf_model

        from sgjax.model.tokenizer import load_tokenizer

        if isinstance(hf_source, str):
            dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
            model, tok = load_hf_model(hf_source, args.hf_device, dtype), load_tokenizer(hf_source)
        else:  # --dummy: HF gets the engine's random weights
            cfg, weights, tok = hf_source
            dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
            model = hf_model_from_weights(cfg, weights, args.hf_device, dtype)
        baseline = BaselineRunner(HFBackend(model, tok, args.hf_device))
        if args.gen_cap:
            baseline.backend.generate = _capped(baseline.backend.generate, args.gen_cap)

    rows, t_start = [], time.perf_counter()
    print(f"set-up (weights, baseline model) took {t_start - t_launch:.0f} s", flush=True)
    for name in names:
        wl = load_workload(stored[name]) if name in stored else build_workload(name, n, args.quick)
        if args.num_programs and len(wl.arguments) > args.num_programs:  # a stored workload, cut down
            wl = wl.subset(args.num_programs)
        print(f"== {name}: {len(wl.arguments)} programs ({wl.description})", flush=True)
        for config in configs:
            t_config = time.perf_counter()
            runner = EngineRunner(make_engine, config, args.threads, args.gen_cap)
            try:
                part = wl.subset(config.max_programs) if config.max_programs else wl
                row = harness.measure(part, runner, args.threads, latency_n, args.repeats)
                if row.get("compiles") and not args.quick:
                    # A shape outside the precompiled set (penalties' history widths, or a CPU run's fine
                    # ladder) compiled inside the timing: measure again, now compiled, and say so.
                    print(f"  {config.name}: {row['compiles']} compiles in the timed run; measuring again", flush=True)
                    row = {
                        **harness.measure(part, runner, args.threads, latency_n, args.repeats),
                        "compiles_first_pass": row["compiles"],
                        "first_pass_s": row["batch_s"],
                    }
            finally:
                runner.close()
            # the wall time of the whole configuration (engine start, warm-up, every timed pass), so a run cut
            # by a timeout shows where its time went
            row["config_wall_s"] = time.perf_counter() - t_config
            rows.append({"workload": name, "config": config.name, **row})
            harness.write_jsonl(rows[-1:], args.out + ".partial")  # survives a timeout later in the run
            print(
                f"  {config.name}: {row['programs_per_s']:.3f} prog/s, hit {row.get('hit_rate', 0):.3f} "
                f"(opt {row.get('optimal_hit_rate') or 0:.3f}), acc {row['accuracy']} "
                f"[{row['config_wall_s']:.0f} s; {time.perf_counter() - t_start:.0f} s in]",
                flush=True,
            )
        if baseline is not None:
            t_config = time.perf_counter()
            # the labelled single-call workloads run in full, so accuracy can be compared program by program
            k = len(wl.arguments) if name in ("mmlu", "hellaswag") else max(latency_n, 1)
            row = harness.measure(wl.subset(k), baseline, 1, 0)
            row["latency_s"] = row["batch_s"] / row["programs"]
            row["prompt_tokens"] = baseline.backend.prompt_tokens
            rows.append({"workload": name, "config": "hf_baseline", **row})
            harness.write_jsonl(rows[-1:], args.out + ".partial")
            print(
                f"  hf_baseline: {row['programs_per_s']:.3f} prog/s [{time.perf_counter() - t_config:.0f} s; "
                f"{time.perf_counter() - t_start:.0f} s in]",
                flush=True,
            )
    harness.add_ratios(rows, "hf_baseline")
    harness.agreement(rows, "hf_baseline")
    meta = {
        "command": command,
        "quick": args.quick,
        "model": args.dummy or args.model_path or "smollm2-135m",
        "platform": _platform(),
        "total_s": time.perf_counter() - t_start,
    }
    for r in rows:
        r.update(meta)
    harness.write_jsonl(rows, args.out)
    harness.print_table(rows)
    plots_dir = args.plots or os.path.dirname(os.path.abspath(args.out))
    write_plots(rows, plots_dir)
    print(f"wrote {len(rows)} rows to {args.out}; total {meta['total_s']:.0f} s")
    print(f"command: {command}")


def write_plots(rows: list[dict], plots_dir: str) -> None:
    try:
        import plots
    except ImportError as e:  # the GPU image has no matplotlib: plot later with --plot-only
        print(f"no plots ({e}); run: python scripts/bench/run.py --plot-only ROWS.jsonl --plots DIR")
        return
    os.makedirs(plots_dir, exist_ok=True)
    title = f"{rows[0]['model']} on {rows[0]['platform']}"
    plots.throughput_figure(rows, os.path.join(plots_dir, "bench_programs_throughput.png"), title)
    plots.hit_rate_figure(rows, os.path.join(plots_dir, "bench_programs_hit_rate.png"), title)
    print(f"plots in {plots_dir}")


def _platform() -> str:
    import jax

    return jax.devices()[0].device_kind


if __name__ == "__main__":
    main()
