"""The launcher's command line: the router flags, workers started with the launcher's engine flags, devices."""

import subprocess
import sys

import pytest

from sgjax.cli import build_parser, split_args
from sgjax.router.launch import visible_gpus, worker_flags


def test_worker_flags_round_trip_to_the_same_settings():
    argv = ["serve", "--max-total-tokens", "4096", "--chunked-prefill-size", "96", "--disable-radix-cache",
            "--no-precompile", "--schedule-policy", "fcfs", "--enable-metrics", "--served-model-name", "tiny",
            "--dp-size", "2", "--router-policy", "round_robin", "--port", "9000", "--host", "0.0.0.0"]
    ns = build_parser().parse_args(argv)
    flags = worker_flags(ns)
    # host, port and the data-parallel flags are the launcher's own; everything else reaches each worker
    assert not {"--port", "--host", "--dp-size", "--router-policy"} & set(flags)
    engine, http = split_args(ns)
    w_engine, w_http = split_args(build_parser().parse_args(["serve", *flags]))
    assert w_engine == engine
    assert (w_http.enable_metrics, w_http.served_model_name) == (True, "tiny")
    assert worker_flags(build_parser().parse_args(["serve", "--dp-size", "3"])) == []


def test_dp_defaults_keep_the_plain_server():
    ns = build_parser().parse_args(["serve"])
    assert (ns.dp_size, ns.router_policy) == (1, "cache_aware")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--router-policy", "fastest"])


def test_router_command_flags():
    ns = build_parser().parse_args(["router", "--worker-urls", "http://a:1", "http://b:2", "--policy",
                                    "shortest_queue", "--cache-threshold", "0.7", "--port", "8001"])
    assert ns.worker_urls == ["http://a:1", "http://b:2"] and ns.router_policy == "shortest_queue"
    assert (ns.cache_threshold, ns.balance_abs_threshold, ns.balance_rel_threshold) == (0.7, 32, 1.0001)
    assert build_parser().parse_args(["router", "--worker-urls", "u", "--router-policy", "random"]).router_policy \
        == "random"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])  # --worker-urls is required
    out = subprocess.run([sys.executable, "-m", "sgjax.cli", "router", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--worker-urls", "--policy", "--cache-threshold", "--balance-abs-threshold",
                 "--balance-rel-threshold", "--health-check-interval"):
        assert flag in out
    out = subprocess.run([sys.executable, "-m", "sgjax.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--dp-size" in out and "--router-policy" in out


def test_visible_gpus(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert visible_gpus() == []
    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []


def test_a_taken_port_fails_before_any_worker_starts():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "sgjax.cli", "serve", "--dp-size", "2", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_a_worker_dies_with_its_launcher():
    """The watchdog of sgjax.router.worker: a child whose parent is killed outright kills itself (even when the
    parent dies before the child's watch starts: the launcher's pid comes in the environment)."""
    import os
    import signal
    import time

    parent_code = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                   "'from sgjax.router.worker import watch_parent; import time; watch_parent(interval=0.1); "
                   "time.sleep(120)'], env={**os.environ, 'SGJAX_LAUNCHER_PID': str(os.getpid())}); "
                   "print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _dead(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its killed parent")


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))  # a zombie is dead
    except FileNotFoundError:
        return True
