"""`sgjax serve` in a child process on a free loopback port: for tests and benchmarks that need the real server."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host=host)[0]


def free_ports(*widths: int, host: str = "127.0.0.1") -> list[int]:
    """One port per width, each the first of `width` consecutive free ports, no two runs overlapping.

    Ports come from below the kernel's ephemeral range, so no outgoing connection or `bind(0)` elsewhere can take
    one between our pick and the child's bind (--dist-init-addr's port + 1 once met another server's port that way);
    all are held while choosing, so the runs cannot overlap each other."""
    low, high = 10_000, _ephemeral_start()
    held: list[socket.socket] = []
    try:
        firsts = []
        for width in widths:
            for _ in range(200):
                run = _bind_run(host, random.randrange(low, high - width), width)
                if run:
                    held += run
                    firsts.append(run[0].getsockname()[1])
                    break
            else:
                raise OSError(f"no {width} consecutive free ports on {host} in [{low}, {high})")
        return firsts
    finally:
        for s in held:
            s.close()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            start = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return start if start > 12_000 else 32768


def _bind_run(host: str, first: int, width: int) -> list[socket.socket] | None:
    run: list[socket.socket] = []
    for port in range(first, first + width):
        s = socket.socket()
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            for r in run:
                r.close()
            return None
        run.append(s)
    return run


class ServerProcess:
    """Starts `python -m sgjax.cli serve --port <free> *flags`; output goes to a log file (kept when it fails).

    `argv` starts another server instead (a peer's, for benchmarks): "{port}" in it becomes the free port, and
    `ready_path` is the GET that answers 200 once it serves."""

    def __init__(
        self,
        *flags: str,
        env: dict | None = None,
        cwd: str | None = None,
        argv: list[str] | None = None,
        ready_path: str = "/health",
        log_prefix: str = "sgjax-server-",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_path = ready_path
        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
        if argv is None:
            argv = [sys.executable, "-m", "sgjax.cli", "serve", "--port", "{port}", *flags]
        self.proc = subprocess.Popen(
            [a.replace("{port}", str(self.port)) for a in argv],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed after `timeout`, so a hung shutdown shows as -9, not a hang)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self, tail: int = 6000) -> str:
        with open(self.log.name) as f:
            return f.read()[-tail:]

    def remove_log(self) -> None:
        self.log.close()
        os.unlink(self.log.name)
