"""Hardening at the HTTP edge: fuzzed bodies on one keep-alive connection (no 5xx, every 400 names a field of the
body, the connection still answers a normal request), a 500 that keeps its connection, bodies refused while they
stream in, and slow or stuck clients that hold nothing."""

import json
import os
import socket
import sys
import time

import httpx
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from tests.server.test_errors import requests

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "perf"))
from soak import field_paths as _paths  # noqa: E402  the heavy fuzzer's rule for "a field of the body"

NORMAL = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def test_fuzzed_bodies_on_one_connection(url):
    with httpx.Client(base_url=url, timeout=30) as conn:

        @settings(
            max_examples=80,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(req=requests())
        def one(req):
            route, raw = req
            r = conn.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code < 500, (route, raw, r.text)
            if r.status_code == 400:
                err = r.json()["error"]
                try:
                    fields = _paths(json.loads(raw)) | {"body"}
                except ValueError:
                    fields = {"body"}
                param = err["param"]
                assert param is not None and err["message"].startswith(param + ":"), (raw, err)
                # the field named is one the client sent, or the route's prompt field (missing / too long)
                assert param in fields or param.split(".")[0] in fields | {"text", "prompt", "messages", "body"}, (
                    raw,
                    err,
                )

        one()
        out = conn.post("/generate", json=NORMAL).json()  # the same connection, after every answer above
        assert out["meta_info"]["completion_tokens"] == 2


def test_a_500_keeps_its_connection():
    from fastapi import FastAPI

    from sgjax.server.app import InternalErrors

    app = FastAPI()
    app.add_middleware(InternalErrors)

    @app.get("/boom")
    async def boom():
        raise KeyError("a bug")

    @app.get("/fine")
    async def fine():
        return {"ok": True}

    with TestClient(app) as client:  # raise_server_exceptions: a re-raised error would fail right here
        r = client.get("/boom")
        assert r.status_code == 500 and r.json()["error"]["message"].startswith("internal error: KeyError")
        assert client.get("/fine").json() == {"ok": True}


def test_a_huge_body_is_refused_before_it_is_read(url):
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000000000\r\n\r\n{"text": '
        )  # 1 GB announced, 9 bytes sent
        answer = b""
        while b"larger than" not in answer and time.monotonic() - t0 < 5:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413") and b"larger than" in answer, answer
        assert time.monotonic() - t0 < 5
