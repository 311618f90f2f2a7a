"""`sgjax router ...` or `sgjax serve --dp-size N ...` in a child process on a free loopback port: for tests and
scripts/perf/bench_router.py. Same life cycle as the server's `ServerProcess` (ready when /health answers 200, which for
a router means at least one worker is up; SIGTERM to stop; output in a log file)."""

from __future__ import annotations

import sys

from sgjax.server.process import ServerProcess


class RouterProcess(ServerProcess):
    def __init__(self, command: str, *flags: str, env: dict | None = None, cwd: str | None = None):
        if command not in ("router", "serve"):
            raise ValueError(f"command must be 'router' or 'serve', got {command!r}")
        super().__init__(
            env=env,
            cwd=cwd,
            log_prefix=f"sgjax-{command}-",
            argv=[sys.executable, "-m", "sgjax.cli", command, "--port", "{port}", *flags],
        )
