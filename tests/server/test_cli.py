"""`sgjax serve`: every engine setting has a documented flag with SGLang's name, and flags reach the engine."""

import dataclasses
import subprocess
import sys
from importlib import metadata

from sgjax.cli import ENGINE_FLAGS, HTTP_FLAGS, build_parser, split_args
from sgjax.engine.engine import ServerArgs
from sgjax.server.serving import HttpArgs

ISSUE_FLAGS = [
    "--model-path",
    "--host",
    "--port",
    "--schedule-policy",
    "--disable-radix-cache",
    "--page-size",
    "--chunked-prefill-size",
    "--mem-fraction-static",
    "--max-total-tokens",
    "--max-running-requests",
    "--attention-backend",
    "--enable-metrics",
    "--log-requests",
    "--disable-jump-forward",
]


def test_every_setting_has_a_flag():
    assert {name for name, _ in ENGINE_FLAGS} == {f.name for f in dataclasses.fields(ServerArgs)}
    assert {name for name, _ in HTTP_FLAGS} == {f.name for f in dataclasses.fields(HttpArgs)}


def test_help_documents_each_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sgjax.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name, options in ENGINE_FLAGS + HTTP_FLAGS:
        flag = "--" + name.replace("_", "-")
        assert flag in out and options["help"].split()[0] in out, flag
    for flag in ISSUE_FLAGS:
        assert flag in out


def test_flags_reach_the_engine_and_defaults_are_the_dataclasses():
    engine, http = split_args(build_parser().parse_args(["serve"]))
    assert engine == ServerArgs() and http == HttpArgs()
    assert http.host == "127.0.0.1"
    engine, http = split_args(
        build_parser().parse_args(
            [
                "serve",
                "--model-path",
                "/m.gguf",
                "--schedule-policy",
                "fcfs",
                "--disable-radix-cache",
                "--page-size",
                "4",
                "--max-total-tokens",
                "1024",
                "--mem-fraction-static",
                "0.5",
                "--max-running-requests",
                "3",
                "--chunked-prefill-size",
                "64",
                "--attention-backend",
                "ref",
                "--disable-jump-forward",
                "--no-precompile",
                "--host",
                "0.0.0.0",
                "--port",
                "8001",
                "--enable-metrics",
                "--log-requests",
            ]
        )
    )
    assert engine == ServerArgs(
        model_path="/m.gguf",
        schedule_policy="fcfs",
        disable_radix_cache=True,
        page_size=4,
        max_total_tokens=1024,
        mem_fraction_static=0.5,
        max_running_requests=3,
        chunked_prefill_size=64,
        attention_backend="ref",
        disable_jump_forward=True,
        precompile=False,
    )
    assert http == HttpArgs(host="0.0.0.0", port=8001, enable_metrics=True, log_requests=True)


def test_console_script():
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts["sgjax"] == "sgjax.cli:main"
