"""`--api-key` through SGLang's router: two `sgjax serve --api-key K` workers behind sglang-router started with the
command `sgjax serve --dp-size N --router sglang --api-key K` runs (router/launch.py). The router asks clients for
the key and passes it on to the workers, which refuse anyone without it; the client's request id comes back."""

import argparse
import sys

import httpx
import openai
import pytest

from sgjax.router.launch import sglang_router_command
from sgjax.server.process import ServerProcess, free_port
from tests.conftest import TINY_SERVE
from tests.server.conftest import serving

KEY = "sekret-key"


@pytest.fixture(scope="module")
def workers(tiny_checkpoint, smollm2_path):
    flags = ["--model-path", tiny_checkpoint, "--load-format", "dummy", "--tokenizer-path", smollm2_path]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in TINY_SERVE.items()] + ["--api-key", KEY]
    gens = [serving(*flags) for _ in range(2)]
    yield [next(g) for g in gens]
    for g in gens:
        next(g, None)


@pytest.fixture(scope="module")
def router(workers):
    ns = argparse.Namespace(host="127.0.0.1", port="{port}", router_policy="round_robin", log_level="warning")
    ns.api_key = KEY
    cmd = sglang_router_command(ns, [w.url for w in workers])
    assert cmd[:3] == [sys.executable, "-m", "sglang_router.launch_router"] and KEY in cmd
    cmd += ["--prometheus-port", str(free_port())]  # not 29000, which another test's router may hold
    proc = ServerProcess(argv=cmd, log_prefix="sglang-router-key-")
    proc.wait_ready(timeout=120)
    yield proc
    assert proc.stop() == 0, proc.log_text()
    proc.remove_log()


def test_the_key_is_asked_for_and_passed_on(router, workers):
    body = {"text": "Hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(router.url + "/generate", json=body, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(router.url + "/generate", json=body, headers=wrong, timeout=60).status_code == 401
    for w in workers:  # the workers themselves refuse a request without the key
        assert httpx.post(w.url + "/generate", json=body, timeout=60).status_code == 401
    direct = httpx.post(workers[0].url + "/generate", json=body, headers=auth, timeout=60).json()
    for i in range(2):  # round robin: each worker once, each answering with the key the router passed on
        r = httpx.post(router.url + "/generate", json=body, headers={**auth, "x-request-id": f"req-{i}"}, timeout=60)
        assert r.status_code == 200 and r.json()["output_ids"] == direct["output_ids"], r.text
        assert r.headers["x-request-id"] == f"req-{i}"
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY)
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert out.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router.url + "/v1", api_key="nope").chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
