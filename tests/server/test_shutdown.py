"""A second server with other flags: --served-model-name, no --enable-metrics, --log-requests; then SIGTERM shuts it
down cleanly: an open stream ends with an abort and [DONE], the process exits with 0."""

import json
import signal
import threading

import httpx

from tests.server.conftest import SMALL_FLAGS, start_server


def test_flags_then_sigterm_ends_streams_and_exits_0():
    srv = start_server(*SMALL_FLAGS, "--skip-server-warmup", "--served-model-name", "tiny", "--log-requests")
    try:
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "tiny"
        assert httpx.get(srv.url + "/metrics").status_code == 404  # only with --enable-metrics

        events, first = [], threading.Event()

        def client():
            body = {
                "text": "Once upon a time",
                "stream": True,
                "rid": "long-one",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            }
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line.removeprefix("data: "))
                        first.set()

        t = threading.Thread(target=client)
        t.start()
        assert first.wait(120)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert srv.proc.wait(60) == 0, srv.log_text()
    finally:
        srv.stop()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine shut down", "status_code": 503}
    assert 0 < last["meta_info"]["completion_tokens"] < 3000
    log = srv.log_text()
    assert "request rids=['long-one']" in log and "finish rid=long-one" in log and '"POST /generate' in log
    srv.remove_log()


def test_sigterm_while_loading_exits_0_at_once():
    import os
    import time

    import jax

    from sgjax.server.process import ServerProcess

    env = {
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
    }
    srv = ServerProcess(*SMALL_FLAGS, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    deadline = time.monotonic() + 120
    while "loading the engine" not in srv.log_text() and time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log_text()
        time.sleep(0.05)
    assert "loading the engine" in srv.log_text()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0, srv.log_text()
    assert time.monotonic() - t0 < 10
    assert "Uvicorn running" not in srv.log_text()  # it never served
    srv.remove_log()
