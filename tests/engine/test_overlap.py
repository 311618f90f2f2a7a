"""The overlap loop (step k+1 reads step k's tokens on the device while the host commits step k) changes when the
host learns each token, never which token: every output must equal the one-step-at-a-time loop's, whatever mix
of requests, and nothing may leak when requests finish or leave while a step is in flight.

sgjax against itself: on the tiny random model with SmolLM2's tokenizer (the `tiny` fixture), whose random text
stops on a common letter and on a spread of stop token ids rather than on EOS."""

import threading
import time

import pytest

from sgjax.model.presets import TINY_SMOLLM2_VOCAB
from tests.engine.conftest import tiny_engine
from tests.engine.test_engine import assert_no_leak

# Every fifth id of the vocabulary: random text meets one within a few tokens (a stop the host learns a step late
# when the loop overlaps).
STOP_IDS = list(range(3, TINY_SMOLLM2_VOCAB.vocab_size, 5))


def mixed_requests(prompt_ids, host_state: bool):
    """Requests that finish at different steps and for every reason, sampled and greedy; with `host_state`, also
    the kinds that need host state (penalties, a grammar, min_new_tokens); a grammar row keeps its step from
    overlapping."""
    params = []
    for i, _ in enumerate(prompt_ids):
        p = {"max_new_tokens": 4 + 3 * (i % 5), "temperature": 0}
        if i % 4 == 1:
            p.update(temperature=0.9, top_p=0.9, sampling_seed=100 + i)
        if i % 7 == 2:
            p.update(stop=["e"])  # random text has an "e" within a few tokens, often inside a token
        if i % 7 == 4:
            p.update(stop_token_ids=STOP_IDS)
        if host_state and i % 6 == 3:
            p.update(frequency_penalty=0.7)
        if host_state and i == 5:
            p.update(regex="(yes|no|maybe) [0-9]{2}")
        if host_state and i == 8:
            p.update(min_new_tokens=3, max_new_tokens=8)
        params.append(p)
    return params


def run(tiny, prompt_ids, host_state=False, longer=0, **server_args):
    params = mixed_requests(prompt_ids, host_state)
    for p in params:
        p["max_new_tokens"] += longer
    with tiny_engine(tiny, **server_args) as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        info = eng.get_server_info()
        assert_no_leak(eng)
    return [
        (
            o["output_ids"],
            o["text"],
            o["meta_info"]["finish_reason"],
            o["meta_info"]["output_token_logprobs"],
            o["meta_info"]["output_top_logprobs"],
        )
        for o in outs
    ], info


@pytest.fixture(scope="module")
def one_at_a_time(tiny, prompt_ids):
    return run(tiny, prompt_ids, disable_overlap_schedule=True)


def assert_same(outs, ref):
    for i, (got, want) in enumerate(zip(outs, ref)):
        assert got[:3] == want[:3], f"request {i}"
        for (lp, tok, _), (lp_ref, tok_ref, _) in zip(got[3], want[3]):
            assert tok == tok_ref and lp == pytest.approx(lp_ref, abs=1e-4), f"request {i}"
        ids = [[None if top is None else [t for _, t, _ in top] for top in o[4]] for o in (got, want)]
        assert ids[0] == ids[1], f"request {i}"  # (forced jump-forward tokens have no top logprobs)
    assert any(o[2]["type"] == "stop" for o in outs) and any(o[2]["type"] == "length" for o in outs)


def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(tiny, prompt_ids, one_at_a_time):
    ref, ref_info = one_at_a_time
    outs, info = run(tiny, prompt_ids)
    assert ref_info["overlapped_steps"] == 0
    assert info["overlapped_steps"] >= 10  # the decode steps after the prefills (max_new_tokens 4..16)
    assert_same(outs, ref)


def test_steps_with_grammar_penalty_or_min_tokens_rows_wait_and_stay_right(tiny, prompt_ids):
    ref, _ = run(tiny, prompt_ids, host_state=True, disable_overlap_schedule=True)
    outs, info = run(tiny, prompt_ids, host_state=True)
    assert_same(outs, ref)
    assert outs[5][1].split(" ")[0] in ("yes", "no", "maybe")


def test_penalty_rows_overlap_and_count_the_token_in_flight(tiny, prompt_ids):
    # Every row penalised, so every decode step overlaps only if penalty rows may; the step after each overlapped
    # one must count the token the host has not read yet (its window holds it as a placeholder), or greedy
    # choices move away from the one-step-at-a-time loop's.
    kinds = [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=1.2),
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=0.8, presence_penalty=0.5, temperature=0.8, sampling_seed=7),
    ]
    params = [
        {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, **kinds[i % 4]} for i in range(len(prompt_ids))
    ]
    results = []
    for disable in (True, False):
        with tiny_engine(tiny, disable_overlap_schedule=disable) as eng:
            outs = eng.generate(input_ids=prompt_ids, sampling_params=params)
            results.append(([o["output_ids"] for o in outs], eng.get_server_info()["overlapped_steps"]))
            assert_no_leak(eng)
    (ref, ref_overlapped), (got, overlapped) = results
    assert ref_overlapped == 0 and overlapped >= 10
    assert got == ref


def test_overlap_under_memory_pressure_retracts_and_stays_right(tiny, prompt_ids):
    # 20 pages for 16 requests of up to ~100 tokens: retractions, which wait for the step in flight.
    pressure = dict(
        longer=24, max_total_tokens=320, chunked_prefill_size=64, max_running_requests=16, schedule_conservativeness=0.0
    )
    ref, ref_info = run(tiny, prompt_ids, disable_overlap_schedule=True, **pressure)
    outs, info = run(tiny, prompt_ids, **pressure)
    assert ref_info["retractions"] > 0 and info["retractions"] > 0 and info["overlapped_steps"] > 0
    assert_same(outs, ref)


def test_requests_aborted_while_their_step_is_in_flight_free_everything(tiny, prompt_ids):
    with tiny_engine(tiny) as eng:
        results, started = {}, threading.Event()

        def consume(i, ids):
            for chunk in eng.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
                stream=True,
            ):
                started.set()
                results[i] = chunk

        threads = [threading.Thread(target=consume, args=(i, ids)) for i, ids in enumerate(prompt_ids[:6])]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(results) < 6 and time.monotonic() < deadline:  # every stream is decoding
            started.wait(0.05)
        for i in range(0, 6, 2):
            eng.abort(results[i]["meta_info"]["id"])
        for t in threads:
            t.join(120)
        assert {results[i]["meta_info"]["finish_reason"]["type"] for i in range(0, 6, 2)} == {"abort"}
        for i in range(1, 6, 2):
            assert results[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
            assert len(results[i]["output_ids"]) == 200
        assert eng.get_server_info()["overlapped_steps"] > 100
        assert_no_leak(eng)


def test_prefill_chunks_and_mixed_steps_are_scheduled_ahead_and_stay_right(tiny, prompt_ids):
    # Prompts of three chunks that share a long prefix arrive beside decoding requests, so the steps are prefill
    # chunks, mixed steps and fills that sample their first token; all of them overlap (the next step is scheduled
    # before their tokens are read), and every token, logprob, prompt logprob and cache hit must equal the
    # one-step-at-a-time loop's. Some requests stop after one token (MMLU's shape), some ask for prompt logprobs.
    from sgjax.engine.steplog import StepRecord

    ids = [prompt_ids[0] * 3 + p for p in prompt_ids[:8]] + prompt_ids[8:]
    params = [
        {"max_new_tokens": 1 if i % 3 == 0 else 7, "temperature": 0 if i % 2 else 0.8, "sampling_seed": 50 + i}
        for i in range(len(ids))
    ]
    results = []
    for disable in (True, False):
        with tiny_engine(tiny, disable_overlap_schedule=disable) as eng:
            eng.step_log: list[StepRecord] = []
            outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=2)
            hits = eng.get_server_info()["cache_hit_rate"]
            # then prompt logprobs (each prompt row's logprob comes with its chunk's commit)
            outs += eng.generate(
                input_ids=ids[4:6], sampling_params=params[4:6], return_logprob=True, logprob_start_len=0
            )
            overlapped = {k: sum(r.overlapped for r in eng.step_log if r.kind == k) for k in ("prefill", "mixed")}
            results.append((outs, overlapped, hits))
            assert_no_leak(eng)
    (ref, ref_overlapped, ref_hits), (got, overlapped, hits) = results
    assert ref_overlapped == {"prefill": 0, "mixed": 0}
    assert overlapped["prefill"] >= 3 and overlapped["mixed"] >= 3, overlapped
    # Scheduled a step earlier, an admission can miss a prefix whose fill is still in flight and shorter than the
    # in-batch wait threshold (one page here): the hit rate may differ by that, never by whole prompts.
    assert ref_hits > 0.3 and abs(hits - ref_hits) < 0.02
    for i, (o, r) in enumerate(zip(got, ref)):
        assert o["output_ids"] == r["output_ids"], f"request {i}"
        m, mr = o["meta_info"], r["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert [t for _, t, _ in m[key]] == [t for _, t, _ in mr[key]], f"request {i} {key}"
            for (lp, _, _), (lp_ref, _, _) in zip(m[key], mr[key]):
                assert lp == pytest.approx(lp_ref, abs=1e-4) if lp_ref is not None else lp is None, f"request {i}"
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in got[-2:]] == [len(p) for p in ids[4:6]]
