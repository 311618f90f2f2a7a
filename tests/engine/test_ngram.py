"""The n-gram drafter (engine/ngram.py) and speculative decoding with it: every drafted token is verified by
sampling its row as decoding would, so a request's tokens (greedy, or sampled with a seed), logprobs and finish
must equal those of plain decoding, whatever was drafted and however much of it was accepted."""

import numpy as np
import pytest

from sgjax.engine.ngram import draft


def test_draft_follows_the_latest_earlier_occurrence_of_the_longest_suffix():
    t = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3], np.int32)
    # suffix [2, 3] occurs at 1 and 7 (and [4, 2, 3] nowhere earlier): the latest, 7, is followed by 7, 8, 4
    assert draft(t, 3) == [7, 8, 4]
    assert draft(t, 1) == [7]
    t2 = np.array([1, 2, 3, 4, 0, 2, 3, 4, 5, 1, 2, 3, 4], np.int32)
    # [2, 3, 4] at 5 is later, but the 4-gram [1, 2, 3, 4] at 0 is longer: it wins
    assert draft(t2, 2) == [0, 2]


def test_draft_is_empty_without_an_earlier_occurrence_or_budget():
    assert draft(np.array([1, 2, 3, 4, 5], np.int32), 4) == []
    assert draft(np.array([1, 2, 1, 2], np.int32), 0) == []
    assert draft(np.array([7], np.int32), 3) == []
    # a single repeated token is not enough (min_match 2), a repeated pair is
    assert draft(np.array([1, 9, 3, 9], np.int32), 2) == []
    assert draft(np.array([1, 9, 3, 1, 9], np.int32), 2) == [3, 1]


def test_draft_runs_on_through_a_loop():
    # [4, 5, 4, 5] occurs at 0, followed by the last two tokens, and then by what the draft repeats of them
    assert draft(np.array([4, 5, 4, 5, 4, 5], np.int32), 5) == [4, 5, 4, 5, 4]
    assert draft(np.array([8, 1, 2, 3, 1, 2], np.int32), 4) == [3, 1, 2, 3]


def spec_requests(prompt_ids):
    """Prompts that repeat themselves (drafts find earlier occurrences) beside plain ones; greedy and seeded
    sampling, stops the host learns mid-draft, token budgets smaller than a draft."""
    ids = [p * 3 for p in prompt_ids[:6]] + prompt_ids[6:12]
    params = []
    for i in range(len(ids)):
        p = {"max_new_tokens": [24, 5, 64, 2][i % 4], "temperature": 0}
        if i % 3 == 1:
            p.update(temperature=0.8, top_p=0.95, sampling_seed=300 + i)
        if i % 5 == 2:
            p.update(stop=["e"])
        if i % 5 == 3:
            p.update(stop_token_ids=list(range(3, 49152, 7)))
        params.append(p)
    return ids, params


def run(tiny, ids, params, **server_args):
    from tests.engine.conftest import tiny_engine
    from tests.engine.test_engine import assert_no_leak

    with tiny_engine(tiny, **server_args) as eng:
        outs = eng.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        info = eng.get_server_info()
        assert_no_leak(eng)
    return outs, info


def test_ngram_speculation_gives_the_outputs_of_plain_decoding(tiny, prompt_ids):
    """Tokens, logprobs, top logprobs and finish as plain decoding, under memory pressure: 20 pages for 12 requests
    (drafts need pages for their rows too, and retracted requests resume with the same tokens); one prompt asks
    for two samples (n = 2), each drafting on its own."""
    ids, params = spec_requests(prompt_ids)
    params = [{**p, "max_new_tokens": p["max_new_tokens"] + 24} for p in params]
    params[1] = {**params[1], "n": 2}
    pressure = dict(max_total_tokens=320, chunked_prefill_size=64, max_running_requests=16, schedule_conservativeness=0)
    ref, ref_info = run(tiny, ids, params, **pressure)
    got, info = run(tiny, ids, params, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5, **pressure)
    for i, (outs, refs) in enumerate(zip(got, ref)):
        for o, r in zip(*((x if isinstance(x, list) else [x]) for x in (outs, refs))):
            assert o["output_ids"] == r["output_ids"], f"request {i}"
            assert o["text"] == r["text"] and o["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
            m, mr = o["meta_info"], r["meta_info"]
            assert [t for _, t, _ in m["output_token_logprobs"]] == o["output_ids"]
            for (lp, _, _), (lp_ref, _, _) in zip(m["output_token_logprobs"], mr["output_token_logprobs"]):
                assert lp == pytest.approx(lp_ref, abs=1e-4), f"request {i}"
            tops = [[t for _, t, _ in x] for x in m["output_top_logprobs"]]
            assert tops == [[t for _, t, _ in x] for x in mr["output_top_logprobs"]], f"request {i}"
    assert ref_info["retractions"] > 0 and info["retractions"] > 0, info
    # drafts accepted whole, in part and not at all
    assert info["spec_rows"] >= 8 and info["spec_accepted_tokens"] > 10, info
    assert info["spec_drafted_tokens"] > info["spec_accepted_tokens"], info
    assert info["spec_accept_length"] > 1.0


def test_draft_model_algorithms_are_refused_by_name(tiny):
    from tests.engine.conftest import tiny_engine

    for algo in ("EAGLE", "NEXTN"):
        with pytest.raises(ValueError, match=f"speculative_algorithm '{algo}' is not built"):
            tiny_engine(tiny, speculative_algorithm=algo)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens must be >= 2"):
        tiny_engine(tiny, speculative_algorithm="NGRAM", speculative_num_draft_tokens=1)


COPY_PROMPTS = [
    "<|im_start|>user\nRepeat this sentence exactly: The old lighthouse keeper climbed the stairs every evening to"
    " light the lamp for the ships.<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "<|im_start|>user\nList the days of the week, one per line.<|im_end|>\n<|im_start|>assistant\n",
]


def test_real_model_greedy_answers_are_unchanged_and_drafts_are_accepted():
    """SmolLM2 on the defaults (the native kernels: a row's logits do not depend on how many rows its request has in
    the step), prompts whose answers copy their context."""
    from sgjax.engine.engine import Engine
    from tests.conftest import SMALL

    greedy = {"max_new_tokens": 48, "temperature": 0}
    outs = []
    for spec in ({}, {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}):
        with Engine(**SMALL, **spec) as eng:
            outs.append([o["output_ids"] for o in eng.generate(COPY_PROMPTS, greedy)])
            info = eng.get_server_info()
    assert outs[0] == outs[1]
    print({k: v for k, v in info.items() if k.startswith("spec")})
    assert info["spec_accepted_tokens"] >= 20 and info["spec_accept_length"] > 1.5, info


def test_speculation_stops_above_its_batch_size_and_the_loop_overlaps_there(tiny, prompt_ids):
    ids, params = spec_requests(prompt_ids)
    ref, _ = run(tiny, ids, params)
    got, info = run(
        tiny,
        ids,
        params,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        speculative_disable_by_batch_size=3,
    )
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert info["spec_rows"] > 0 and info["overlapped_steps"] > 0  # drafts in the tail, overlap while many run


def test_a_step_that_admits_past_the_batch_size_still_verifies_its_drafts(tiny, prompt_ids):
    # Two slots, speculation below two running: a lone request drafts, and the same step admits a waiting one (the
    # batch reaches the size); that step must still be read before the next is scheduled (its drafts are verified
    # on the host), while the steps after it overlap.
    ids, params = spec_requests(prompt_ids)
    ref, _ = run(tiny, ids, params, max_running_requests=2)
    got, info = run(
        tiny,
        ids,
        params,
        max_running_requests=2,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        speculative_disable_by_batch_size=2,
    )
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert info["spec_rows"] > 0 and info["overlapped_steps"] > 0


def test_constrained_rows_draft_within_the_grammar_and_keep_their_outputs(tiny, prompt_ids):
    # A draft under a grammar ends before its first forbidden token; each drafted row samples under the mask of the
    # state the draft reaches there (and the budget left there), and jump-forward still appends forced text after
    # the verified tokens. Repetitive languages, so that drafts exist; greedy and seeded sampling.
    regexes = ["(yes|no)( (yes|no)){4,60}\\.", "(ab|ba|abc)+;", "\\[(1|22|333)(, (1|22|333)){2,40}\\]"]
    ids = [prompt_ids[i] * 2 for i in range(6)]
    params = [
        {
            "max_new_tokens": 40 + 8 * i,
            "regex": regexes[i % 3],
            **({"temperature": 0.9, "sampling_seed": 7 + i} if i % 2 else {"temperature": 0}),
        }
        for i in range(6)
    ]
    ref, _ = run(tiny, ids, params)
    got, info = run(tiny, ids, params, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in ref]
    assert info["spec_rows"] > 5 and info["spec_accepted_tokens"] > 0, info


def test_a_draft_never_outlives_its_planning():
    # A planning that drafted and then had to retract (or found the batch past the cut) leaves drafts on requests;
    # the next planning must draft again or clear them, never reuse drafts (and grammar states) of an older context.
    import dataclasses

    from sgjax.engine.params import SamplingParams
    from sgjax.engine.request import Req
    from sgjax.engine.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_pages=64, page_size=4, num_draft_tokens=4))
    req = Req(rid="0", input_ids=[5, 6, 7, 5, 6, 7, 5, 6], params=SamplingParams(max_new_tokens=20), seed=0)
    sched.add(req)
    works = sched.schedule()
    for w in works:
        w.target_results = []
    sched.commit(works, [7], [0.0], None)
    assert [(n, decode) for _, n, decode in sched._plan_running()] == [(4, True)] and req.draft == [5, 6, 7]
    sched.cfg = dataclasses.replace(sched.cfg, spec_below_running=1)  # now past the cut: no drafts
    assert [(n, decode) for _, n, decode in sched._plan_running()] == [(1, True)] and req.draft == []
