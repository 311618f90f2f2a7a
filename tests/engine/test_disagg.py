"""Prefill/decode disaggregation (engine/disagg.py) with two in-process engines, as sglang-router drives two workers:
every request goes to both with one room; the decode engine's tokens equal a single engine's, its prompts' pages
came from the prefill engine, pulled through jax's transfer (engine/disagg_transfer.py) or as bytes on the bootstrap
socket, and after 50 requests with aborts on either side neither engine has lost a page. A pull that never comes
fails within its timeout; the transport is the one named, or for `auto` jax where it works."""

import random
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from sgjax.engine import disagg
from sgjax.engine.args import ServerArgs
from sgjax.engine.disagg_transfer import DeviceTransfer
from sgjax.engine.requests import GenerateCall
from sgjax.server.process import free_ports
from tests.engine.conftest import tiny_engine
from tests.engine.test_engine import assert_no_leak

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SETTINGS = dict(page_size=4, max_total_tokens=2048)


@pytest.fixture(scope="module")
def engines(tiny):
    (port,) = free_ports(1)
    with (
        tiny_engine(tiny, disaggregation_mode="prefill", disaggregation_bootstrap_port=port, **SETTINGS) as prefill,
        tiny_engine(tiny, disaggregation_mode="decode", **SETTINGS) as decode,
    ):
        decode.disagg_timeout = 20.0
        assert prefill.transfer is not None and decode.transfer is not None  # auto: jax's transfer works here
        yield prefill, decode, port


@pytest.fixture(params=["jax", "socket"])
def pair(engines, request):
    """The engines with the decode one asking for a pull (jax) or, without its transport, for the bytes (socket):
    each side asks or offers its own way, so one pair serves both. Their caches start empty: the decode engine's
    pages come from this test's transfers."""
    prefill, decode, port = engines
    assert prefill.flush_cache() and decode.flush_cache()
    transfer = decode.transfer
    if request.param == "socket":
        decode.transfer = None
    yield prefill, decode, port
    decode.transfer = transfer


@pytest.fixture(scope="module")
def single_greedy(tiny, prompt_ids):
    with tiny_engine(tiny, **SETTINGS) as single:
        return [o["output_ids"] for o in single.generate(input_ids=prompt_ids[:6], sampling_params=PARAMS)]


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


def test_decode_engine_continues_from_the_prefill_engines_pages(pair, prompt_ids, single_greedy):
    prefill, decode, _ = pair
    before = decode.get_server_info()
    room0 = 1000 if decode.transfer is not None else 2000
    for i, ids in enumerate(prompt_ids[:6]):
        got, first = both(pair, ids, PARAMS, room=room0 + i)
        assert got["output_ids"] == single_greedy[i], i
        assert len(first["output_ids"]) == 1  # the prefill worker makes one token
    info = decode.get_server_info()
    received = info["disaggregation_received_tokens"] - before["disaggregation_received_tokens"]
    assert received >= sum(len(p) // 4 * 4 for p in prompt_ids[:6]) - 4 * 6  # nearly every whole page arrived
    pulls = info["disaggregation_pulls"] - before["disaggregation_pulls"]
    socket_bytes = info["disaggregation_socket_kv_bytes"] - before["disaggregation_socket_kv_bytes"]
    if decode.transfer is not None:  # every room pulled device to device, no page byte on the socket
        assert pulls == 6 and socket_bytes == 0
        assert info["disaggregation_transfer_backend"] == "jax"
    else:
        assert pulls == 0 and socket_bytes > 0
    assert prefill.get_server_info()["disaggregation_mode"] == "prefill"


def test_fifty_requests_with_aborts_lose_no_page_on_either_side(pair, prompt_ids):
    prefill, decode, _ = pair
    rng = random.Random(0)
    room0 = 5000 if decode.transfer is not None else 6000

    def abort(pair, room):
        side = rng.choice(["p", "d", None, None])
        if side is not None:
            (prefill if side == "p" else decode).abort(f"{side}-{room}")

    for i in range(50):
        ids = prompt_ids[i % len(prompt_ids)] + [7 + i]
        both(pair, ids, {**PARAMS, "max_new_tokens": rng.randint(1, 20)}, room=room0 + i, abort=abort)
    assert_no_leak(prefill)
    assert_no_leak(decode)
    assert len(prefill.kv_store) <= 50  # rooms a decode engine never asked for (aborted) wait for their ttl


def test_a_pull_that_never_comes_fails_within_its_timeout_and_the_next_one_works():
    """An offer that is gone (taken, lapsed, a dead worker) leaves a pull waiting forever in jax 0.10 / 0.11: the
    timer fails it, and the poisoned connection is not used again."""
    pool = jnp.zeros((2, 8, 3), jnp.float32)
    server, puller = DeviceTransfer(pool), DeviceTransfer(pool)
    kv = [jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3), jnp.ones((2, 1, 3), jnp.float32)]
    header = server.offer("127.0.0.1", 7, kv, timeout=30)
    assert puller.pull(header, timeout=5)[0].sum() == kv[0].sum()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="failed"):
        puller.pull(header, timeout=1)  # taken already
    assert time.monotonic() - start < 5
    header = server.offer("127.0.0.1", 8, kv, timeout=30)
    got = puller.pull(header, timeout=5)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(kv[1]))
    assert puller.pulls == 2 and server.offers == 2
    (dead,) = free_ports(1)
    with pytest.raises(ConnectionError):
        puller.pull({**header, "address": f"127.0.0.1:{dead}"}, timeout=1)  # nobody there: no hang either


def test_the_transport_is_the_one_named_or_for_auto_jax_where_it_works(monkeypatch):
    for name in ("jax", "socket"):
        assert disagg.transfer_backend(ServerArgs(disaggregation_transfer_backend=name)) == name
    assert ServerArgs().disaggregation_transfer_backend == "auto"
    assert disagg.transfer_backend(ServerArgs()) == "jax"
    monkeypatch.setattr(disagg, "unavailable", lambda: "jax 0.0 has no jax.experimental.transfer")
    assert disagg.transfer_backend(ServerArgs()) == "socket"
    assert disagg.transfer_backend(ServerArgs(disaggregation_transfer_backend="socket")) == "socket"
    with pytest.raises(ValueError, match="jax cannot run here: jax 0.0 has no jax.experimental.transfer; use socket"):
        disagg.transfer_backend(ServerArgs(disaggregation_transfer_backend="jax"))


def test_runs_cover_the_pages_in_powers_of_two():
    assert disagg.runs(13) == [(0, 8), (8, 12), (12, 13)]
    assert disagg.runs(16) == [(0, 16)] and disagg.runs(0) == []


def test_refused_by_name(tiny):
    with pytest.raises(ValueError, match="mooncake"):
        tiny_engine(tiny, disaggregation_mode="decode", disaggregation_transfer_backend="mooncake")
    with pytest.raises(ValueError, match="prefix cache"):
        tiny_engine(tiny, disaggregation_mode="decode", disable_radix_cache=True)


def test_a_tensor_parallel_pair_pulls_shard_to_shard_and_another_sharding_gets_the_bytes(tiny, engines, prompt_ids):
    """Prefill and decode engines with the pool split over 2 devices: the pages move shard to shard, and the decode
    engine's tokens equal the prefill engine's own; an unsharded decode engine asking it gets the bytes."""
    (port,) = free_ports(1)
    with (
        tiny_engine(
            tiny, disaggregation_mode="prefill", disaggregation_bootstrap_port=port, tp_size=2, **SETTINGS
        ) as p,
        tiny_engine(tiny, disaggregation_mode="decode", tp_size=2, **SETTINGS) as d,
    ):
        ids = prompt_ids[0]
        want = p.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"]  # no room: a whole request
        got, _ = both((p, d, port), ids, PARAMS, room=9000)
        assert got["output_ids"] == want
        assert (
            d.get_server_info()["disaggregation_pulls"] == 1
            and d.get_server_info()["disaggregation_socket_kv_bytes"] == 0
        )
        unsharded = engines[1]
        before = unsharded.get_server_info()["disaggregation_socket_kv_bytes"]
        both((p, unsharded, port), prompt_ids[1], PARAMS, room=9001)
        assert unsharded.get_server_info()["disaggregation_socket_kv_bytes"] > before
