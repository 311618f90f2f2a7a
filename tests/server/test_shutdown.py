"""SIGTERM shuts the server down cleanly: an open stream ends with an abort and [DONE], the process exits with 0."""

import json
import signal
import threading

import httpx

from tests.server.conftest import SMALL_FLAGS, start_server


def test_sigterm_ends_streams_and_exits_0():
    srv = start_server(*SMALL_FLAGS, "--skip-server-warmup")
    try:
        events, first = [], threading.Event()

        def client():
            body = {"text": "Once upon a time", "stream": True,
                    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
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
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "message": "engine shut down"}
    assert 0 < last["meta_info"]["completion_tokens"] < 3000
    srv.remove_log()
