"""One bad request never fails the others: a row that cannot be built is aborted alone, out-of-range values are
bounded before the int32 / float32 rows, live ids are unique, aborted results carry no placeholder ids, and grammars
and images that would cost minutes or gigabytes are 400s."""

import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from sgjax.engine.engine import Engine
from sgjax.engine.images import ImageDataError, _open
from sgjax.engine.params import SamplingParamsError
from sgjax.errors import RequestError
from sgjax.model.config import ModelConfig
from sgjax.model.weights import dummy_weights

# SmolLM2's vocabulary, so its tokenizer's text and grammars work on random weights
CFG = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def engine(smollm2):
    with Engine.from_weights(
        CFG,
        dummy_weights(CFG, seed=3),
        smollm2[2],
        max_total_tokens=2048,
        max_running_requests=8,
        chunked_prefill_size=64,
        grammar_compile_timeout=2.0,
    ) as eng:
        yield eng


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_a_row_that_cannot_be_built_is_aborted_alone(engine, monkeypatch):
    clean = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    original = engine.runner._sampling_rows

    def poisoned(works, *args):  # a bug that only one request's parameters reach
        if any(w.req.params.max_new_tokens == 7 for w in works):
            raise OverflowError("a value does not fit its int32 row")
        return original(works, *args)

    monkeypatch.setattr(engine.runner, "_sampling_rows", poisoned)
    params = [GREEDY, {**GREEDY, "max_new_tokens": 7}, GREEDY, GREEDY]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    monkeypatch.undo()
    reason = outs[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "OverflowError" in reason["message"] and reason["status_code"] == 500
    assert [o["output_ids"] for i, o in enumerate(outs) if i != 1] == [c for i, c in enumerate(clean) if i != 1]
    engine.check_invariants()


def test_huge_top_k_and_temperature_are_bounded_not_fatal(engine):
    # top_k = 2**40 once overflowed the int32 sampling row while the step was built: every request of the step failed
    sampled = {"max_new_tokens": 6, "temperature": 1e300, "top_k": 2**40, "seed": 5, "ignore_eos": True}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=[GREEDY, sampled, GREEDY, sampled])
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    same_seed = engine.generate(input_ids=PROMPTS[1], sampling_params={**sampled, "top_k": -1, "temperature": 1e6})
    assert outs[1]["output_ids"] == same_seed["output_ids"]  # top_k past the vocabulary is no top-k


def test_two_live_requests_never_share_an_id(engine):
    stream = engine.generate(
        input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 200}, rid="twin", stream=True
    )
    next(stream)
    with pytest.raises(RequestError) as e:
        engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, rid="twin")
    assert e.value.field == "rid"
    with pytest.raises(RequestError):
        engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY, rid=["a", "a"])
    stream.close()  # leaving the stream aborts it; then the id is free again
    deadline = time.monotonic() + 30
    while True:
        try:
            assert (
                engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, rid="twin")["meta_info"]["id"] == "twin"
            )
            break
        except RequestError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_aborted_results_carry_no_placeholder_ids(engine):
    results = {}

    def consume(i):
        for chunk in engine.generate(
            input_ids=PROMPTS[i], sampling_params={**GREEDY, "max_new_tokens": 500}, stream=True, rid=f"long-{i}"
        ):
            results[i] = chunk

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (
        len(results) < 3 or min(r["meta_info"]["completion_tokens"] for r in results.values()) < 3
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    for i in range(3):
        engine.abort(f"long-{i}")
    for t in threads:
        t.join(60)
    assert engine.get_server_info()["overlapped_steps"] > 0  # so aborts met placeholders in flight
    for r in results.values():
        assert r["meta_info"]["finish_reason"] == {"type": "abort"}
        assert all(t >= 0 for t in r["output_ids"]) and r["meta_info"]["completion_tokens"] == len(r["output_ids"])
    engine.check_invariants()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("regex", "[\u0000-\U0010ffff]{1000}", "longer than 2 s"),  # 60 bytes that once took 104 s to compile
        ("regex", "(" * 3000 + "a" + ")" * 3000, "nested too deeply"),
        ("json_schema", '{"type": "array", "items": ' * 400 + '{"type": "integer"}' + "}" * 400, "nested too deeply"),
    ],
)
def test_costly_grammars_are_refused_by_name_and_fast(engine, field, value, words):
    t0 = time.monotonic()
    for _ in range(2):  # the second time from the failure cache, at once
        with pytest.raises(SamplingParamsError) as e:
            engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, field: value})
        assert e.value.field == field and words in str(e.value)
    assert time.monotonic() - t0 < 20
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 8


def test_decompression_bombs_are_refused_before_decoding():
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")  # 400 M pixels in ~50 KB
    with pytest.raises(ImageDataError, match="pixels"):
        _open(buf.getvalue(), None, 0)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
    assert _open(buf.getvalue(), None, 0).size == (8, 8)


def test_calls_being_tokenized_count_as_queued(engine, monkeypatch):
    """--max-queued-requests reads queued_requests(): a burst whose calls are all still being tokenized must be
    counted, or every one of them passes the check (seen as 504s instead of 503s on a busy machine)."""
    import asyncio

    gate, real = threading.Event(), engine._make_requests
    monkeypatch.setattr(engine, "_make_requests", lambda call: gate.wait(10) and real(call))

    async def burst():
        tasks = [asyncio.ensure_future(engine.async_generate("hi", {"max_new_tokens": 1})) for _ in range(3)]
        await asyncio.sleep(0.3)
        during = engine.queued_requests()
        gate.set()
        await asyncio.gather(*tasks)
        return during

    assert asyncio.run(burst()) == 3
    assert engine.queued_requests() == 0
