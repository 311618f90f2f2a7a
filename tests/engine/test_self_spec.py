"""Self-speculation (`--speculative-algorithm SELF`, engine/drafter.py): the model's first layers draft on the
device, the step verifies as it does NGRAM's drafts, so every request's tokens, logprobs and finish equal plain
decoding's, under a grammar, stops, seeded sampling, n = 2 and retraction alike; the draft layers are checked."""

import pytest

from sgjax.engine.args import ServerArgs
from sgjax.engine.drafter import draft_layers
from sgjax.model.presets import TINY_LLAMA
from tests.engine.test_ngram import COPY_PROMPTS, run, spec_requests


def test_mixed_requests_under_memory_pressure_keep_plain_decodings_outputs(tiny, prompt_ids):
    """Greedy and seeded rows, stops met mid-draft, budgets shorter than a draft, n = 2, a regex request (its
    drafts cut at the grammar's first forbidden token) and a pool small enough to retract: all as plain decoding."""
    ids, params = spec_requests(prompt_ids)
    params = [{**p, "max_new_tokens": p["max_new_tokens"] + 24} for p in params]
    params[1] = {**params[1], "n": 2}
    params[4] = {"max_new_tokens": 40, "regex": "(yes|no)( (yes|no)){4,60}\\.", "temperature": 0}
    pressure = dict(max_total_tokens=320, chunked_prefill_size=64, max_running_requests=16, schedule_conservativeness=0)
    ref, ref_info = run(tiny, ids, params, **pressure)
    got, info = run(tiny, ids, params, speculative_algorithm="SELF", speculative_num_draft_tokens=4, **pressure)

    def flat(outs, key):
        return [[x[key] for x in o] if isinstance(o, list) else o[key] for o in outs]

    assert flat(got, "output_ids") == flat(ref, "output_ids")
    finish = [o["meta_info"]["finish_reason"] for o in got if not isinstance(o, list)]
    assert finish == [o["meta_info"]["finish_reason"] for o in ref if not isinstance(o, list)]
    for o, r in zip(got, ref):
        if isinstance(o, list):
            continue
        lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert ref_info["retractions"] > 0 and info["retractions"] > 0, info
    # the first layer of two drafts: rows carried drafts, and some of them stood
    assert info["spec_rows"] > 20 and info["spec_accepted_tokens"] > 0, info


def test_real_model_greedy_answers_are_unchanged():
    """SmolLM2 (30 layers) drafting with 28: the answers of plain decoding, and part of the drafts stand."""
    from sgjax.engine.engine import Engine
    from tests.conftest import SMALL

    greedy = {"max_new_tokens": 24, "temperature": 0}
    outs = []
    spec = {"speculative_algorithm": "SELF", "speculative_num_draft_tokens": 4, "speculative_draft_layers": 28}
    for kw in ({}, spec):
        with Engine(**SMALL, **kw) as eng:
            outs.append([o["output_ids"] for o in eng.generate(COPY_PROMPTS[:3], greedy)])
            info = eng.get_server_info()
    assert outs[0] == outs[1]
    assert info["spec_accepted_tokens"] > 5 and info["spec_accept_length"] > 1.2, info


def test_draft_layers_default_to_half_and_must_leave_a_layer_out():
    deep = TINY_LLAMA.replace(num_layers=30)
    assert draft_layers(ServerArgs(), deep) == 15
    assert draft_layers(ServerArgs(speculative_draft_layers=28), deep) == 28
    assert draft_layers(ServerArgs(), TINY_LLAMA) == 1
    for bad in (30, -1):
        with pytest.raises(ValueError, match="speculative_draft_layers must be in \\[1, 29\\]"):
            draft_layers(ServerArgs(speculative_draft_layers=bad), deep)
