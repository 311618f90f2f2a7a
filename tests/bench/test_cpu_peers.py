"""scripts/perf/bench_cpu_peers.py's mmlu workload: prompts and labels from the MMLU data, a peer's server started
on a free port from its argv, the questions sent over /v1/completions with at most --batch in flight, and the
row's arithmetic (accuracy against the labels, prompt tokens, the cached share) from the replies. The server here
is a stdlib stand-in that answers like an OpenAI server; the real peers are the benchmark's business."""

import os
import sys
import types

import httpx
import pytest

sys.path[:0] = [
    os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "perf"),
    os.path.join(os.path.dirname(__file__), "..", "..", "scripts"),
]
from cpu_peers_served import MMLU_SUBJECTS, ServedPeer, measure_mmlu, mmlu_questions, server_argv  # noqa: E402

# Answers " B" to every prompt; usage counts characters as tokens and reports a tenth of them cached, so the
# expected row follows from the prompts alone.
STAND_IN = r"""
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock, live, peak = threading.Lock(), [0], [0]

class H(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "stand-in"}], "peak_in_flight": peak[0]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)
        with lock:
            live[0] -= 1
        assert req["model"] == "stand-in" and req["max_tokens"] == 1 and req["temperature"] == 0
        n = len(req["prompt"])
        self._send({"choices": [{"text": " B"}],
                    "usage": {"prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n // 10}}})

    def log_message(self, *a):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_questions_share_a_prefix_per_subject_and_carry_their_answers():
    prompts, labels = mmlu_questions(MMLU_SUBJECTS[1:3], 5)
    assert len(prompts) == len(labels) == 5 and set(labels) <= set("ABCD")
    heads = [p.split("\n\n")[0] for p in prompts]
    assert heads[0] != heads[1] and heads[0] == heads[2] == heads[4] and heads[1] == heads[3]  # interleaved
    assert all(p.endswith("\nAnswer:") and p.count("Answer:") == 6 for p in prompts)  # 5 shots, then the question


def test_sgjax_server_flags_follow_the_engine_arguments():
    args = types.SimpleNamespace(
        sgjax_args='{"weight_dtype": "int4", "disable_radix_cache": true}', model_path="m.gguf", batch=16
    )
    argv, _, ready = server_argv("sgjax", args)
    assert argv[argv.index("--weight-dtype") + 1] == "int4" and "--disable-radix-cache" in argv
    assert argv[argv.index("--max-running-requests") + 1] == "16" and "{port}" in argv and ready == "/health"
    with pytest.raises(ImportError):
        server_argv("vllm", types.SimpleNamespace(vllm_python="/no/such/python"))


def test_mmlu_row_from_a_served_peer(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    peer = ServedPeer("stand-in", [sys.executable, str(script), "{port}"], {}, "/v1/models")
    try:
        assert peer.model == "stand-in"
        row = measure_mmlu(peer, MMLU_SUBJECTS[1:3], types.SimpleNamespace(mmlu_questions=8, batch=3))
        assert httpx.get(peer.server.url + "/v1/models").json()["peak_in_flight"] == 3  # --batch at a time
    finally:
        peer.close()
    prompts, labels = mmlu_questions(MMLU_SUBJECTS[1:3], 8)
    assert row["questions"] == 8 and row["prompt_tokens"] == sum(map(len, prompts))
    assert row["accuracy"] == labels.count("B") / 8
    assert row["cached_share"] == sum(len(p) // 10 for p in prompts) / sum(map(len, prompts))
    assert row["questions_per_s"] > 0 and row["cpu_ms_per_question"] >= 0
    assert peer.server.proc.poll() is not None  # closed
