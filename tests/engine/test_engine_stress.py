"""Many random requests through the real engine loop on a tiny random model: random lengths, sampling settings,
stop conditions and aborts from client threads, without and with speculative decoding (SELF: every decoding row
drafts). Nothing may leak, hang or break the engine."""

import threading

import numpy as np
import pytest

from sgjax.engine.engine import Engine
from sgjax.model.presets import TINY_LLAMA
from sgjax.model.weights import dummy_weights


@pytest.fixture(scope="module", params=[None, "SELF"], ids=["plain", "self-speculation"])
def tiny_engine(smollm2_tokenizer, request):
    # Its own pool on purpose: pages of 4 tokens and room for few requests, so pages, retraction and the cache's
    # eviction are all under pressure. With self-speculation every decoding row drafts: verify rows grow pages
    # that rejected tokens leave, and aborts land between a draft and its verify.
    spec = {"speculative_algorithm": request.param, "speculative_num_draft_tokens": 3} if request.param else {}
    eng = Engine.from_weights(
        TINY_LLAMA,
        dummy_weights(TINY_LLAMA, seed=1),
        smollm2_tokenizer,
        page_size=4,
        max_total_tokens=1024,
        chunked_prefill_size=64,
        max_running_requests=16,
        **spec,
    )
    yield eng
    eng.shutdown()


def random_params(rng):
    p = {"max_new_tokens": int(rng.integers(0, 24))}
    if rng.random() < 0.5:
        p.update(
            temperature=float(rng.uniform(0.5, 1.5)),
            top_p=float(rng.uniform(0.5, 1.0)),
            top_k=int(rng.choice([-1, 5, 50])),
            seed=int(rng.integers(1000)),
        )
    else:
        p["temperature"] = 0.0
    if rng.random() < 0.3:
        p["stop"] = [str(rng.choice(["a", "e", " the", "\n", "zz", "."]))]
    if rng.random() < 0.3:
        p["stop_token_ids"] = rng.integers(0, 512, 50).tolist()
    if rng.random() < 0.2:
        p["ignore_eos"] = True
    return p


def test_500_random_requests_with_aborts_leak_nothing(tiny_engine):
    eng = tiny_engine
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 512, int(rng.integers(4, 120))).tolist() for _ in range(6)]
    results, errors = {}, []

    def client(worker: int):
        r = np.random.default_rng(worker)
        for i in range(50):
            ids = (
                prefixes[r.integers(6)][: int(r.integers(1, 120))] + r.integers(0, 512, int(r.integers(0, 30))).tolist()
            )
            rid = f"{worker}-{i}"
            try:
                if r.random() < 0.25:  # a streaming client that leaves early
                    stream = eng.generate(input_ids=ids, sampling_params=random_params(r), stream=True, rid=rid)
                    for _ in range(int(r.integers(1, 4))):
                        if next(stream, None) is None:
                            break
                    stream.close()
                else:
                    if r.random() < 0.2:
                        threading.Timer(float(r.uniform(0, 0.05)), eng.abort, (rid,)).start()
                    results[rid] = eng.generate(
                        input_ids=ids, sampling_params=random_params(r), rid=rid, return_logprob=bool(r.random() < 0.2)
                    )
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    assert len(results) > 300
    reasons = {res["meta_info"]["finish_reason"]["type"] for res in results.values()}
    assert {"length", "abort"} <= reasons
    for res in results.values():
        meta = res["meta_info"]
        if meta["finish_reason"]["type"] == "length":
            assert meta["completion_tokens"] == meta["finish_reason"]["length"]
    info = eng.get_server_info()
    eng.check_invariants()
    assert info["running_requests"] == info["waiting_requests"] == info["protected_pages"] == 0
    assert info["free_pages"] + info["evictable_pages"] == info["num_pages"]
    assert info["retractions"] > 0 or info["cached_tokens"] > 0
    if eng.args.speculative_algorithm:
        assert info["spec_rows"] > 100 and info["spec_accepted_tokens"] > 0, info
    # Still serving.
    assert (
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "ignore_eos": True})["meta_info"][
            "completion_tokens"
        ]
        == 3
    )
