"""The `sgjax` command. `sgjax serve [flags]` (or `python -m sgjax.cli serve`) starts the HTTP server; the flags
carry SGLang's names (--model-path, --schedule-policy, --disable-radix-cache, ...), one per engine setting."""

from __future__ import annotations

import argparse
import sys

from sgjax.engine import kv_calibrate
from sgjax.engine.args import ENGINE_FLAGS, ServerArgs
from sgjax.router import launch as router
from sgjax.server.args import HTTP_FLAGS, HttpArgs

__all__ = ["ENGINE_FLAGS", "HTTP_FLAGS", "build_parser", "main", "split_args"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgjax", description="SGLang on JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="start the HTTP server (SGLang's /generate and OpenAI's /v1 APIs)",
        description="Start the HTTP server: SGLang's native /generate and OpenAI-compatible /v1/completions, "
        "/v1/chat/completions and /v1/models, plus /health, /get_model_info, /get_server_info, "
        "/flush_cache and /metrics (with --enable-metrics).",
    )
    for title, table, defaults in (("engine", ENGINE_FLAGS, ServerArgs()), ("http", HTTP_FLAGS, HttpArgs())):
        group = serve.add_argument_group(title)
        for name, options in table:
            default = getattr(defaults, name)
            help_ = options["help"]
            if default is not None and default is not False and "default" not in help_:
                help_ += f" (default: {default})"
            group.add_argument("--" + name.replace("_", "-"), dest=name, default=default, **{**options, "help": help_})
    # Data parallelism (sgjax/router, docs/router.md): `serve --dp-size N --router-policy P` and `sgjax router`.
    router.add_dp_flags(serve)
    router.add_router_command(commands)
    kv_calibrate.add_command(commands)
    return parser


def split_args(ns: argparse.Namespace):
    """(ServerArgs, HttpArgs) from parsed flags."""
    engine = ServerArgs(**{name: getattr(ns, name) for name, _ in ENGINE_FLAGS})
    http = HttpArgs(**{name: getattr(ns, name) for name, _ in HTTP_FLAGS})
    return engine, http


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.command == "serve" and getattr(ns, "dp_size", 1) > 1 and ns.nnodes > 1:
        raise SystemExit("sgjax serve: --dp-size with --nnodes > 1 is not supported yet")
    if ns.command == "kv-scales":
        kv_calibrate.main(ns)
    elif ns.command == "router" or getattr(ns, "dp_size", 1) > 1:
        router.main(ns)
    elif ns.command == "serve":
        from sgjax.server.launch import serve  # the engine, jax and the model code: not for `sgjax --help`

        serve(*split_args(ns))


if __name__ == "__main__":
    main()
