"""The real server in a subprocess (`python -m sgjax.cli serve`) on a free loopback port, with the real SmolLM2 and
the tests' persistent compilation cache; helpers to read SSE streams and check leaks. The session's shared server
(`server`, `url`, `client`) is in tests/conftest.py: tests/lang uses it too."""

import json
import os
import time

import httpx

from sgjax.server.process import ServerProcess
from tests.conftest import SMALL

# The in-process engines' settings as flags: the same pool and step shapes, so the compilation cache they fill
# serves the server.
SMALL_FLAGS = [x for name, value in SMALL.items() for x in ("--" + name.replace("_", "-"), str(value))]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(*flags: str, env: dict | None = None) -> ServerProcess:
    """The server with the tests' CPU platform and persistent compilation cache (every compile is kept); `env` adds
    to its environment (e.g. JAX_NUM_CPU_DEVICES for --tp-size)."""
    import jax

    env = {
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        **(env or {}),
    }
    return ServerProcess(*flags, env=env, cwd=REPO).wait_ready()


def serving(*flags: str, env: dict | None = None):
    """A fixture body: the server for the fixture's scope, which must exit cleanly on SIGTERM."""
    srv = start_server(*flags, env=env)
    yield srv
    rc = srv.stop()
    assert rc == 0, f"server exit status {rc} after SIGTERM:\n{srv.log_text()}"
    srv.remove_log()


def sse_events(lines) -> list:
    """The `data:` payloads of an SSE stream, JSON-decoded, with the final "[DONE]" kept as a string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get("/get_server_info").json()
        if info["running_requests"] == info["waiting_requests"] == 0 or time.monotonic() > deadline:
            return info


def assert_no_leak(client: httpx.Client) -> None:
    info = wait_idle(client)
    assert info["running_requests"] == info["waiting_requests"] == 0, info
    assert info["protected_pages"] == 0, info
    assert info["free_pages"] + info["evictable_pages"] == info["num_pages"], info
