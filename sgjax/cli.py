"""The `sgjax` command. `sgjax serve [flags]` (or `python -m sgjax.cli serve`) starts the HTTP server; the flags
carry SGLang's names (--model-path, --schedule-policy, --disable-radix-cache, ...), one per engine setting."""

from __future__ import annotations

import argparse
import sys

# (ServerArgs field, argparse options). Every engine setting has a flag (tests/server/test_cli.py checks it).
ENGINE_FLAGS = [
    ("model_path", dict(help="GGUF file or HF model directory (default: the bundled SmolLM2-135M-Instruct)")),
    ("load_format", dict(choices=["auto", "dummy"],
                         help="auto: the checkpoint's weights; dummy: random weights of the HF directory's "
                              "config.json (serving benchmarks of large shapes)")),
    ("dtype", dict(choices=["float32", "bfloat16"],
                   help="weights and KV cache dtype (default: float32 on CPU, bfloat16 on accelerators)")),
    ("page_size", dict(type=int, help="tokens per KV page; the radix cache matches whole pages")),
    ("max_total_tokens", dict(type=int, help="KV pool size in tokens (default: from --mem-fraction-static; 16384 "
                                             "on CPU, where memory stats are missing)")),
    ("mem_fraction_static", dict(type=float, help="fraction of device memory for weights and the KV pool, used "
                                                  "when --max-total-tokens is not given")),
    ("max_running_requests", dict(type=int, help="most requests in one running batch")),
    ("chunked_prefill_size", dict(type=int, help="most prompt tokens prefilled in one step; longer prompts are "
                                                 "prefilled in chunks")),
    ("schedule_policy", dict(choices=["lpm", "dfs-weight", "fcfs", "random"],
                             help="order of waiting requests: lpm (longest prefix match first), dfs-weight, fcfs, "
                                  "random")),
    ("schedule_conservativeness", dict(type=float, help="scales the pages reserved for future output tokens at "
                                                        "admission; 0 admits greedily")),
    ("disable_radix_cache", dict(action="store_true", help="no prefix reuse (the paper's no-cache ablation)")),
    ("cache", dict(choices=["radix", "table", "none"],
                   help="prefix cache: radix tree, flat table (the no-tree ablation) or none")),
    ("attention_backend", dict(choices=["ref", "pallas", "pallas:triton", "pallas:mgpu"],
                               help="attention implementation (default: ref on CPU, pallas on GPU and TPU)")),
    ("context_length", dict(type=int, help="longest prompt plus output (default: the model's)")),
    ("max_top_logprobs_num", dict(type=int, help="largest top_logprobs_num (logprobs, top_logprobs) a request "
                                                 "may ask for")),
    ("precompile", dict(action=argparse.BooleanOptionalAction,
                        help="compile the common step shapes at start (default: on accelerators only)")),
    ("step_buckets", dict(choices=["fine", "coarse"],
                          help="step-shape ladder: fine fits requests, logits rows and top-logprobs to each batch "
                               "(cheap CPU compiles), coarse derives them from the token count (fewer shapes where "
                               "a compile costs seconds); default: fine on CPU, coarse on accelerators")),
    ("random_seed", dict(type=int, help="seed of the seeds given to requests that bring none")),
    ("skip_tokenizer_init", dict(action="store_true", help="no tokenizer: /generate takes input_ids and answers "
                                                           "output_ids only; the OpenAI routes are refused")),
    ("disable_jump_forward", dict(action="store_true", help="decode a grammar's forced text token by token "
                                                            "(same output, more steps)")),
    ("grammar_cache_size", dict(type=int, help="compiled regex / JSON-schema grammars kept; 0 rebuilds one per "
                                               "request (the paper's ablation)")),
    ("compilation_cache_dir", dict(help="JAX's persistent compilation cache, used when JAX_COMPILATION_CACHE_DIR "
                                        "is not set; '' for none")),
    ("gil_switch_interval_ms", dict(type=float, help="Python's thread switch interval while serving (the engine "
                                                     "loop shares the GIL with the HTTP server's threads)")),
    ("disable_overlap_schedule", dict(action="store_true", help="wait for each step's tokens before scheduling the "
                                                                "next (no overlap of host work with decode steps)")),
]

HTTP_FLAGS = [
    ("host", dict(help="address to listen on (loopback by default: expose it on purpose)")),
    ("port", dict(type=int, help="port to listen on")),
    ("served_model_name", dict(help="model name in the OpenAI API (default: the model file's name)")),
    ("enable_metrics", dict(action="store_true", help="serve Prometheus metrics at /metrics")),
    ("log_requests", dict(action="store_true", help="log every request's inputs, outputs and HTTP access lines")),
    ("log_level", dict(choices=["debug", "info", "warning", "error"], help="logging level")),
    ("skip_server_warmup", dict(action="store_true", help="skip the warm-up request before listening")),
]


def build_parser() -> argparse.ArgumentParser:
    from sgjax.engine.args import ServerArgs
    from sgjax.server.serving import HttpArgs

    parser = argparse.ArgumentParser(prog="sgjax", description="SGLang on JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="start the HTTP server (SGLang's /generate and OpenAI's /v1 APIs)",
        description="Start the HTTP server: SGLang's native /generate and OpenAI-compatible /v1/completions, "
                    "/v1/chat/completions and /v1/models, plus /health, /get_model_info, /get_server_info, "
                    "/flush_cache and /metrics (with --enable-metrics).")
    for title, table, defaults in (("engine", ENGINE_FLAGS, ServerArgs()), ("http", HTTP_FLAGS, HttpArgs())):
        group = serve.add_argument_group(title)
        for name, options in table:
            default = getattr(defaults, name)
            help_ = options["help"]
            if default is not None and default is not False and "default" not in help_:
                help_ += f" (default: {default})"
            group.add_argument("--" + name.replace("_", "-"), dest=name, default=default, **{**options, "help": help_})
    # Data parallelism (sgjax/router, docs/router.md): `serve --dp-size N --router-policy P` and `sgjax router`.
    from sgjax.router.launch import add_dp_flags, add_router_command

    add_dp_flags(serve)
    add_router_command(commands)
    return parser


def split_args(ns: argparse.Namespace):
    """(ServerArgs, HttpArgs) from parsed flags."""
    from sgjax.engine.args import ServerArgs
    from sgjax.server.serving import HttpArgs

    engine = ServerArgs(**{name: getattr(ns, name) for name, _ in ENGINE_FLAGS})
    http = HttpArgs(**{name: getattr(ns, name) for name, _ in HTTP_FLAGS})
    return engine, http


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "router" or getattr(ns, "dp_size", 1) > 1:
        from sgjax.router.launch import main as router_main

        router_main(ns)
    elif ns.command == "serve":
        from sgjax.server.launch import serve

        serve(*split_args(ns))


if __name__ == "__main__":
    main()
