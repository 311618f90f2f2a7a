"""Real processes for the router's end-to-end tests, each started once per session: `sgjax serve --dp-size 2`
(two real SmolLM2 workers on CPU with the server tests' small pool and the persistent compilation cache, behind a
cache_aware router in the launcher), and a second, round_robin `sgjax router` in front of the same two workers."""

import httpx
import jax
import pytest

from sgjax.router.process import RouterProcess
from tests.server.conftest import REPO, SMALL_FLAGS


def _env() -> dict:
    # As tests/server/conftest.py's start_server: CPU, offline, every compile kept in the tests' cache.
    return {
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def start(command: str, *flags: str) -> RouterProcess:
    return RouterProcess(command, *flags, env=_env(), cwd=REPO).wait_ready(timeout=600)


@pytest.fixture(scope="session")
def launcher():
    proc = start("serve", *SMALL_FLAGS, "--dp-size", "2", "--router-policy", "cache_aware")
    yield proc
    proc.stop()  # test_e2e's last test checks the exit status and the workers; this is only the safety net


@pytest.fixture(scope="session")
def workers(launcher) -> list[dict]:
    """The launcher's workers: url and pid."""
    info = httpx.get(launcher.url + "/get_server_info", timeout=60).json()
    return [{"url": w["url"], "pid": w["pid"]} for w in info["router"]["workers"]]


@pytest.fixture(scope="session")
def rr_router(workers):
    proc = start("router", "--worker-urls", *[w["url"] for w in workers], "--policy", "round_robin")
    yield proc
    rc = proc.stop()
    assert rc == 0, f"router exit status {rc}:\n{proc.log_text()}"
    proc.remove_log()


@pytest.fixture(scope="session")
def ca(launcher):
    with httpx.Client(base_url=launcher.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def rr(rr_router):
    with httpx.Client(base_url=rr_router.url, timeout=300) as c:
        yield c
