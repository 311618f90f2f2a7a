"""`sgjax router ...` or `sgjax serve --dp-size N ...` in a child process on a free loopback port: for tests and
scripts/perf/bench_router.py. Same life cycle as the server's `ServerProcess` (ready when /health answers 200, which for
a router means at least one worker is up; SIGTERM to stop; output in a log file)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from sgjax.server.process import ServerProcess, free_port


class RouterProcess(ServerProcess):
    def __init__(self, command: str, *flags: str, env: dict | None = None, cwd: str | None = None):
        if command not in ("router", "serve"):
            raise ValueError(f"command must be 'router' or 'serve', got {command!r}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"sgjax-{command}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "sgjax.cli", command, "--port", str(self.port), *flags],
                                     cwd=cwd, env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT)
