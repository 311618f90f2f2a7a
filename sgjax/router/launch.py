"""`sgjax router --worker-urls ...` (front running servers) and `sgjax serve --dp-size N` (start N worker servers,
then front them): the flags, the worker processes, and the router's uvicorn.

Workers are `sgjax serve` children (`python -m sgjax.router.worker serve`) on free loopback ports with the
launcher's engine flags. With --tp-size M each worker is a TP=M engine on its own M GPUs (worker i: GPUs
[i*M, (i+1)*M) in CUDA_VISIBLE_DEVICES); on CPU they are N processes sharing the cores, each with M host devices. The
router listens on --host/--port once every worker answers /health. SIGTERM or
SIGINT: the workers get SIGTERM first (each ends its open streams with an abort, so the router's relays end too),
uvicorn shuts down, the launcher waits for the workers and exits with status 0. A worker also kills itself within a
second if the launcher is killed outright (worker.py), so no worker outlives it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import uvicorn

from sgjax.errors import RequestError
from sgjax.router.policy import POLICIES, make_policy
from sgjax.server.connection import check_port
from sgjax.server.process import free_port

log = logging.getLogger("sgjax.router")

# The launcher's pid, in each worker's environment: the worker's watchdog (worker.py) ends it when that process dies.
LAUNCHER_PID_ENV = "SGJAX_LAUNCHER_PID"
WORKER_START_TIMEOUT = 1800.0  # a first start on a GPU compiles the step shapes
# HTTP flags the workers share with the launcher (host and port are the router's own).
_WORKER_HTTP_FLAGS = (
    "served_model_name",
    "enable_metrics",
    "log_requests",
    "log_level",
    "skip_server_warmup",
    "api_key",
    "stream_interval",
    "max_queued_requests",
    "profile_dir",
    "tool_call_parser",
    "reasoning_parser",
)


# -- flags (sgjax/cli.py calls these two) ----------------------------------------------------------------------
def add_dp_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("data parallel (docs/router.md)")
    group.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="worker servers behind a cache-aware router; 1 serves from this process alone (default: 1)",
    )
    group.add_argument(
        "--router-policy",
        choices=POLICIES,
        default="cache_aware",
        help="with --dp-size > 1: how the router picks a worker (default: cache_aware)",
    )
    group.add_argument(
        "--router",
        choices=("sgjax", "sglang"),
        default="sgjax",
        help="with --dp-size > 1: sgjax's own router, or SGLang's Rust router (`pip install sglang-router`: "
        "circuit breakers, retries, rate limits, Prometheus; policies cache_aware, round_robin, random) "
        "(default: sgjax)",
    )


def add_router_command(commands) -> None:
    p = commands.add_parser(
        "router",
        help="the data-parallel router in front of running sgjax servers",
        description="Forward /generate and the OpenAI routes to one of several `sgjax serve` workers, by prefix "
        "affinity (cache_aware) or load; /flush_cache to all; /get_server_info adds them up.",
    )
    p.add_argument("--worker-urls", nargs="+", required=True, metavar="URL", help="the workers' base URLs")
    p.add_argument(
        "--policy",
        "--router-policy",
        dest="router_policy",
        choices=POLICIES,
        default="cache_aware",
        help="how a worker is picked (default: cache_aware)",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: least matched share of the prompt that routes by affinity (default: 0.5)",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=32,
        help="cache_aware: in-flight difference above which (with the relative one) the least-loaded "
        "worker is used (default: 32)",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.0001,
        help="cache_aware: in-flight ratio above which (with the absolute one) the least-loaded worker "
        "is used (default: 1.0001)",
    )
    p.add_argument(
        "--health-check-interval",
        type=float,
        default=5.0,
        help="seconds between /health probes of the workers; 0: only on demand (default: 5)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default: 30000)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--log-requests", action="store_true", help="HTTP access lines")
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer <key>` on every route but /health and /ready, and send it to the workers",
    )
    p.add_argument(
        "--first-byte-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may take to send a request's first byte (a whole answer when not "
        "streamed); then it is marked down and the request goes to another worker (default: 600)",
    )


def main(ns: argparse.Namespace) -> None:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.command == "router":
        policy = (
            make_policy(
                ns.router_policy,
                cache_threshold=ns.cache_threshold,
                balance_abs_threshold=ns.balance_abs_threshold,
                balance_rel_threshold=ns.balance_rel_threshold,
            )
            if ns.router_policy == "cache_aware"
            else make_policy(ns.router_policy)
        )
        check_port(ns.host, ns.port)
        _for_exit_status_0()
        run_router(
            ns.worker_urls,
            policy,
            ns.host,
            ns.port,
            ns.log_level,
            ns.log_requests,
            health_interval=ns.health_check_interval,
            api_key=ns.api_key,
            first_byte_timeout=ns.first_byte_timeout,
        )
    else:
        serve_dp(ns)


# -- the router ------------------------------------------------------------------------------------------------
class _RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


def run_router(
    urls,
    policy,
    host,
    port,
    log_level="info",
    log_requests=False,
    pids=None,
    on_exit=lambda: None,
    health_interval: float = 5.0,
    api_key: str | None = None,
    first_byte_timeout: float = 600.0,
) -> None:
    from sgjax.router.app import build_router_app
    from sgjax.router.proxy import Router

    router = Router(
        list(urls),
        policy,
        pids=pids,
        health_interval=health_interval,
        api_key=api_key,
        first_byte_timeout=first_byte_timeout,
    )
    config = uvicorn.Config(
        build_router_app(router),
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_requests,
        timeout_graceful_shutdown=10,
    )
    _RouterServer(config, on_exit).run()


def _for_exit_status_0() -> None:
    # uvicorn restores the previous handlers after its graceful shutdown and raises the signal again: no-op handlers
    # let the process end normally, with status 0 (as sgjax/server/launch.py).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)


# -- the workers -----------------------------------------------------------------------------------------------
def serve_dp(ns: argparse.Namespace) -> None:
    if ns.dp_size < 2:
        raise SystemExit(f"--dp-size must be >= 2 here, got {ns.dp_size}")
    check_port(ns.host, ns.port)
    flags = worker_flags(ns)
    gpus = visible_gpus()
    try:
        envs = worker_devices(ns.dp_size, ns.tp_size, gpus)
    except RequestError as e:
        raise SystemExit(f"sgjax serve: {e}") from None
    if ns.tp_size == 1 and 0 < len(gpus) < ns.dp_size:
        log.warning(
            "%d workers share %d GPU(s): lower --mem-fraction-static or --max-total-tokens so their pools fit together",
            ns.dp_size,
            len(gpus),
        )

    def stop_now(sig, frame):
        raise SystemExit(0)

    # Until uvicorn runs, and again when it re-raises the signal after its graceful shutdown: leave through the
    # `finally`, which stops the workers, with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_now)
    workers: list[WorkerProcess] = []
    try:
        for i, env in enumerate(envs):
            workers.append(WorkerProcess(flags, env))
            gpu = env.get("CUDA_VISIBLE_DEVICES")
            log.info(
                "worker %d: %s (pid %d%s)", i, workers[-1].url, workers[-1].proc.pid, f", GPU {gpu}" if gpu else ""
            )
        wait_ready(workers)
        if ns.router == "sglang":
            run_sglang_router(ns, [w.url for w in workers])
            return
        policy = make_policy(ns.router_policy)
        run_router(
            [w.url for w in workers],
            policy,
            ns.host,
            ns.port,
            ns.log_level,
            ns.log_requests,
            pids=[w.proc.pid for w in workers],
            on_exit=lambda: [w.terminate() for w in workers],
            api_key=ns.api_key,
        )
    finally:
        stop_workers(workers)


SGLANG_POLICIES = ("cache_aware", "round_robin", "random")  # ours that sglang-router also has, by the same name


def sglang_router_command(ns: argparse.Namespace, urls: list[str]) -> list[str]:
    """`python -m sglang_router.launch_router` in front of the workers, with the launcher's host, port, policy and
    API key (the router sends it on to the workers)."""
    if ns.router_policy not in SGLANG_POLICIES:
        raise SystemExit(f"--router sglang: --router-policy must be one of {', '.join(SGLANG_POLICIES)}")
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", ns.host, "--port", str(ns.port)]
    level = {"warning": "warn", "critical": "error", "trace": "debug"}.get(ns.log_level.lower(), ns.log_level.lower())
    cmd += ["--worker-urls", *urls, "--policy", ns.router_policy, "--log-level", level]
    return cmd + (["--api-key", ns.api_key] if ns.api_key else [])


def run_sglang_router(ns: argparse.Namespace, urls: list[str]) -> None:
    """Run SGLang's router until it exits or the launcher is asked to stop (then it gets SIGTERM first)."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise SystemExit("--router sglang needs SGLang's router: pip install sglang-router")
    router = subprocess.Popen(sglang_router_command(ns, urls))
    log.info("sglang-router on %s:%d (pid %d) in front of %s", ns.host, ns.port, router.pid, " ".join(urls))

    def stop(sig, frame):
        router.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    router.wait()


def worker_flags(ns: argparse.Namespace) -> list[str]:
    """The launcher's engine flags (and shared HTTP ones) as a worker's command line: the values that differ from
    `sgjax serve`'s defaults."""
    from sgjax.engine.args import ENGINE_FLAGS, ServerArgs
    from sgjax.server.args import HTTP_FLAGS, HttpArgs

    defaults = {**vars(ServerArgs()), **vars(HttpArgs())}  # the flags' defaults (sgjax.cli.build_parser)
    options = dict(ENGINE_FLAGS + HTTP_FLAGS)
    out = []
    for name in [n for n, _ in ENGINE_FLAGS] + list(_WORKER_HTTP_FLAGS):
        value, flag = getattr(ns, name), "--" + name.replace("_", "-")
        if value == defaults[name]:
            continue
        action = options[name].get("action")
        if action == "store_true":
            out.append(flag)
        elif action is argparse.BooleanOptionalAction:
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def worker_devices(dp: int, tp: int, gpus: list[str]) -> list[dict[str, str]]:
    """Each worker's device environment. On GPUs worker i gets gpus[i*tp:(i+1)*tp]; a worker of one GPU may share
    it when there are fewer GPUs than workers (small models), but a tensor-parallel worker needs tp GPUs of its own:
    overlapping device lists would put two workers' preallocated pools and their collectives on the same GPUs. On CPU
    (no GPU ids) a worker
    gets tp host devices (jax reads JAX_NUM_CPU_DEVICES; it wins over XLA_FLAGS' device count)."""
    if not gpus:
        return [{"JAX_NUM_CPU_DEVICES": str(tp)} if tp > 1 else {} for _ in range(dp)]
    if tp == 1:
        return [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if len(gpus) > 1 else {} for i in range(dp)]
    if len(gpus) < dp * tp:
        raise RequestError(
            f"--dp-size {dp} x --tp-size {tp} needs {dp * tp} GPUs, but {len(gpus)} are visible ({','.join(gpus)})",
            "tp_size",
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp : (i + 1) * tp])} for i in range(dp)]


def visible_gpus() -> list[str]:
    """Device ids for CUDA_VISIBLE_DEVICES: the ones already visible, else nvidia-smi's; none on CPU."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


class WorkerProcess:
    """One `sgjax serve` (through `sgjax.router.worker`, which ends it if the launcher dies) on a free loopback
    port; its output goes to the launcher's."""

    def __init__(self, flags: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **(env or {}), LAUNCHER_PID_ENV: str(os.getpid())}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sgjax.router.worker",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *flags,
            ],
            env=env,
        )

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def wait_ready(workers: list[WorkerProcess], timeout: float = WORKER_START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.proc.poll() is not None:
                raise SystemExit(f"worker {w.url} exited with status {w.proc.returncode} while starting")
            try:
                if httpx.get(w.url + "/health", timeout=2).status_code == 200:
                    pending.remove(w)
                    log.info("worker %s ready", w.url)
            except httpx.TransportError:
                pass
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"workers not ready after {timeout:.0f} s: {[w.url for w in pending]}")
        if pending:
            time.sleep(0.5)


def stop_workers(workers: list[WorkerProcess], timeout: float = 60.0) -> None:
    """SIGTERM to all at once, again every few seconds while any runs (a worker still loading its model can lose
    one: the server's loading-time handler raises SystemExit, which is swallowed when the signal lands in a garbage
    collector callback), then SIGKILL for any still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        running = [w for w in workers if w.proc.poll() is None]
        if not running or time.monotonic() > deadline:
            break
        for w in running:
            w.terminate()
        try:
            running[0].proc.wait(min(5.0, max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.proc.poll() is None:
            log.warning("worker %s did not stop in %.0f s: killed", w.url, timeout)
            w.proc.kill()
            w.proc.wait()
        if w.proc.returncode not in (0, -signal.SIGTERM):
            log.warning("worker %s exited with status %s", w.url, w.proc.returncode)
