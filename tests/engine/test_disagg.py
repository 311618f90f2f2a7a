"""Prefill/decode disaggregation (engine/disagg.py) with two in-process engines, as sglang-router drives two workers:
every request goes to both with one room; the decode engine's tokens equal a single engine's, its prompts' pages
came from the prefill engine over the bootstrap socket, and after 50 requests with aborts on either side neither
engine has lost a page."""

import random
import threading

import pytest

from sgjax.engine.requests import GenerateCall
from sgjax.server.process import free_ports
from tests.engine.conftest import tiny_engine
from tests.engine.test_engine import assert_no_leak

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tiny):
    (port,) = free_ports(1)
    settings = dict(page_size=4, max_total_tokens=2048)
    with (
        tiny_engine(tiny, disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **settings) as prefill,
        tiny_engine(tiny, disaggregation_mode="decode", **settings) as decode,
    ):
        decode.disagg_timeout = 20.0
        yield prefill, decode, port


def both(pair, ids, params, room, abort=None):
    """A request to the prefill and the decode engine at once (the router's way); returns the decode result."""
    prefill, decode, port = pair
    boot = [("127.0.0.1", port, room)]
    out = {}

    def run(engine, key):
        call = GenerateCall(input_ids=[ids], sampling_params=params, rid=[f"{key}-{room}"], bootstrap=boot)
        out[key] = engine.run(call)[0]

    threads = [threading.Thread(target=run, args=(e, k)) for e, k in ((prefill, "p"), (decode, "d"))]
    for t in threads:
        t.start()
    if abort is not None:
        abort(pair, room)
    for t in threads:
        t.join(60)
    return out["d"], out["p"]


def test_decode_engine_continues_from_the_prefill_engines_pages(pair, tiny, prompt_ids):
    prefill, decode, _ = pair
    with tiny_engine(tiny, page_size=4, max_total_tokens=2048) as single:
        want = [o["output_ids"] for o in single.generate(input_ids=prompt_ids[:6], sampling_params=PARAMS)]
    before = decode.get_server_info()["disaggregation_received_tokens"]
    for i, ids in enumerate(prompt_ids[:6]):
        got, first = both(pair, ids, PARAMS, room=1000 + i)
        assert got["output_ids"] == want[i], i
        assert len(first["output_ids"]) == 1  # the prefill worker makes one token
    received = decode.get_server_info()["disaggregation_received_tokens"] - before
    assert received >= sum(len(p) // 4 * 4 for p in prompt_ids[:6]) - 4 * 6  # nearly every whole page arrived
    assert prefill.get_server_info()["disaggregation_mode"] == "prefill"


def test_fifty_requests_with_aborts_lose_no_page_on_either_side(pair, prompt_ids):
    prefill, decode, _ = pair
    rng = random.Random(0)

    def abort(pair, room):
        side = rng.choice(["p", "d", None, None])
        if side is not None:
            (prefill if side == "p" else decode).abort(f"{side}-{room}")

    for i in range(50):
        ids = prompt_ids[i % len(prompt_ids)] + [7 + i]
        both(pair, ids, {**PARAMS, "max_new_tokens": rng.randint(1, 20)}, room=5000 + i, abort=abort)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    assert len(prefill.kv_store) <= 50  # rooms a decode engine never asked for (aborted) wait for their ttl


def test_refused_by_name(tiny):
    with pytest.raises(ValueError, match="mooncake"):
        tiny_engine(tiny, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake")
    with pytest.raises(ValueError, match="prefix cache"):
        tiny_engine(tiny, disaggregation_mode="decode", disable_radix_cache=True)
