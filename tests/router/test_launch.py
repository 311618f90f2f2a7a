"""The launcher's command line: the router flags, workers started with the launcher's engine flags, devices."""

import subprocess
import sys

import pytest

from sgjax.cli import build_parser, split_args
from sgjax.router.launch import visible_gpus, worker_flags


def test_worker_flags_round_trip_to_the_same_settings():
    argv = [
        "serve",
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "96",
        "--disable-radix-cache",
        "--no-precompile",
        "--schedule-policy",
        "fcfs",
        "--enable-metrics",
        "--served-model-name",
        "tiny",
        "--dp-size",
        "2",
        "--router-policy",
        "round_robin",
        "--port",
        "9000",
        "--host",
        "0.0.0.0",
    ]
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
    ns = build_parser().parse_args(
        [
            "router",
            "--worker-urls",
            "http://a:1",
            "http://b:2",
            "--policy",
            "shortest_queue",
            "--cache-threshold",
            "0.7",
            "--port",
            "8001",
        ]
    )
    assert ns.worker_urls == ["http://a:1", "http://b:2"] and ns.router_policy == "shortest_queue"
    assert (ns.cache_threshold, ns.balance_abs_threshold, ns.balance_rel_threshold) == (0.7, 32, 1.0001)
    assert (
        build_parser().parse_args(["router", "--worker-urls", "u", "--router-policy", "random"]).router_policy
        == "random"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router"])  # --worker-urls is required
    out = subprocess.run(
        [sys.executable, "-m", "sgjax.cli", "router", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--worker-urls",
        "--policy",
        "--cache-threshold",
        "--balance-abs-threshold",
        "--balance-rel-threshold",
        "--health-check-interval",
    ):
        assert flag in out
    out = subprocess.run(
        [sys.executable, "-m", "sgjax.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
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
        r = subprocess.run(
            [sys.executable, "-m", "sgjax.cli", "serve", "--dp-size", "2", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_a_worker_dies_with_its_launcher():
    """The watchdog of sgjax.router.worker: a child whose parent is killed outright kills itself (even when the
    parent dies before the child's watch starts: the launcher's pid comes in the environment)."""
    import os
    import signal
    import time

    parent_code = (
        "import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
        "'from sgjax.router.worker import watch_parent; import time; watch_parent(interval=0.1); "
        "time.sleep(120)'], env={**os.environ, 'SGJAX_LAUNCHER_PID': str(os.getpid())}); "
        "print(p.pid, flush=True); time.sleep(120)"
    )
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


def test_worker_devices():
    """Worker i's GPUs are [i*tp, (i+1)*tp) of the visible ones; too few for dp x tp is refused naming both."""
    from sgjax.errors import RequestError
    from sgjax.router.launch import worker_devices

    gpus = ["3", "4", "5", "6", "7"]
    assert worker_devices(2, 2, gpus) == [{"CUDA_VISIBLE_DEVICES": "3,4"}, {"CUDA_VISIBLE_DEVICES": "5,6"}]
    assert worker_devices(2, 1, gpus) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "4"}]
    assert worker_devices(3, 1, ["0", "1"])[2] == {"CUDA_VISIBLE_DEVICES": "0"}  # one-GPU workers may share
    assert worker_devices(2, 1, ["0"]) == [{}, {}]
    with pytest.raises(RequestError, match=r"--dp-size 3 x --tp-size 2 needs 6 GPUs, but 5 are visible") as e:
        worker_devices(3, 2, gpus)
    assert e.value.field == "tp_size"
    assert worker_devices(2, 2, []) == [{"JAX_NUM_CPU_DEVICES": "2"}] * 2  # CPU: host devices per process
    assert worker_devices(2, 1, []) == [{}, {}]


def test_too_few_gpus_for_dp_times_tp_is_refused(monkeypatch):
    from sgjax.cli import main

    monkeypatch.setenv("JAX_PLATFORMS", "")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(SystemExit, match="--dp-size 2 x --tp-size 2 needs 4 GPUs, but 3 are visible"):
        main(["serve", "--dp-size", "2", "--tp-size", "2", "--port", "0"])


def test_dp_workers_are_tensor_parallel_engines(tiny_checkpoint, smollm2_path):
    """`sgjax serve --dp-size 2 --tp-size 2` on CPU: each worker is a TP=2 engine on 2 host devices of its own
    process (the launcher gives them), both answer with one device's greedy text, and the router reports the
    layout."""
    import httpx

    from sgjax.engine.engine import Engine
    from sgjax.router.process import RouterProcess
    from sgjax.router.proxy import WORKER_HEADER
    from tests.conftest import TINY_SERVE
    from tests.router.conftest import _env
    from tests.server.conftest import REPO

    prompt, params = "The capital of France is", {"max_new_tokens": 8, "temperature": 0.0}
    flags = [x for name, value in TINY_SERVE.items() for x in ("--" + name.replace("_", "-"), str(value))]
    proc = RouterProcess(
        "serve",
        *flags,
        "--model-path",
        tiny_checkpoint,
        "--tokenizer-path",
        smollm2_path,
        "--load-format",
        "dummy",
        "--skip-server-warmup",
        "--tp-size",
        "2",
        "--dp-size",
        "2",
        "--router-policy",
        "round_robin",
        env=_env(),
        cwd=REPO,
    )
    try:
        proc.wait_ready(timeout=600)
        with httpx.Client(base_url=proc.url, timeout=300) as c:
            got = [c.post("/generate", json={"text": prompt, "sampling_params": params}) for _ in range(2)]
            info = c.get("/get_server_info").json()
        assert all(r.status_code == 200 for r in got), [r.text for r in got]
        assert {r.headers[WORKER_HEADER] for r in got} == {w["url"] for w in info["workers"]}  # one each
        for w in info["workers"]:
            assert w["info"]["tp_size"] == 2 and w["info"]["mesh_shape"] == {"data": 1, "tensor": 2}, w
        assert (info["dp_size"], info["tp_size"], info["nnodes"]) == (2, 2, 1)
        assert info["mesh_shape"] == {"data": 1, "tensor": 2}
        engine = Engine(tiny_checkpoint, load_format="dummy", tokenizer_path=smollm2_path, **TINY_SERVE)
        try:
            want = engine.generate(prompt, params)["text"]
        finally:
            engine.shutdown()
        assert [r.json()["text"] for r in got] == [want, want] and want
    finally:
        rc = proc.stop()
    assert rc == 0, proc.log_text()
    proc.remove_log()
