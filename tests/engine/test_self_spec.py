"""Speculation with a model drafting on the device (engine/drafter.py): SELF (the model's first layers) and
STANDALONE (a draft model with a pool of its own). The step verifies as it does NGRAM's drafts, so every request's
tokens, logprobs and finish equal plain decoding's, under a grammar, stops, seeded sampling, n = 2 and retraction
alike; a draft model equal to the target has every draft accepted (the ceiling); the flags are checked."""

import dataclasses
import json

import numpy as np
import pytest

from sgjax.engine.args import ServerArgs
from sgjax.engine.drafter import draft_layers, load_draft
from sgjax.model.presets import TINY_LLAMA
from tests.engine.test_ngram import COPY_PROMPTS, run, spec_requests


def write_hf(cfg, weights, path) -> str:
    """A model as an HF safetensors directory (config.json + model.safetensors), as a draft model path."""
    from safetensors.numpy import save_file

    from sgjax.model.families import hf_config_dict
    from sgjax.model.weights import to_hf_state_dict

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in to_hf_state_dict(cfg, weights).items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    return str(path)


@pytest.fixture(scope="module")
def tiny_draft(tiny, tmp_path_factory):
    """The tiny model itself as a draft model path: a draft equal to its target."""
    cfg, weights, _ = tiny
    return write_hf(cfg, weights, tmp_path_factory.mktemp("tiny-draft"))


def test_mixed_requests_under_memory_pressure_keep_plain_decodings_outputs(tiny, prompt_ids, tiny_draft):
    """Greedy and seeded rows, stops met mid-draft, budgets shorter than a draft, n = 2, a regex request (its
    drafts cut at the grammar's first forbidden token) and a pool small enough to retract: all as plain decoding,
    for SELF and for STANDALONE (whose draft pool catches up on every retracted request's tokens again)."""
    ids, params = spec_requests(prompt_ids)
    ids, params = ids[:8], params[:8]
    params[1] = {**params[1], "n": 2}
    params[4] = {"max_new_tokens": 40, "regex": "(yes|no)( (yes|no)){4,60}\\.", "temperature": 0}
    pressure = dict(max_total_tokens=272, chunked_prefill_size=64, max_running_requests=16, schedule_conservativeness=0)
    ref, ref_info = run(tiny, ids, params, **pressure)
    assert ref_info["retractions"] > 0

    def flat(outs, key):
        return [[x[key] for x in o] if isinstance(o, list) else o[key] for o in outs]

    # float32 named: auto would narrow the draft checkpoint's matrices to bf16 on a CPU with bf16 dots
    drafters = {"SELF": {}, "STANDALONE": {"speculative_draft_model_path": tiny_draft, "dtype": "float32"}}
    for algo, extra in drafters.items():
        spec = dict(speculative_algorithm=algo, speculative_num_draft_tokens=4, **extra)
        got, info = run(tiny, ids, params, **spec, **pressure)
        assert flat(got, "output_ids") == flat(ref, "output_ids"), algo
        finish = [o["meta_info"]["finish_reason"] for o in got if not isinstance(o, list)]
        assert finish == [o["meta_info"]["finish_reason"] for o in ref if not isinstance(o, list)], algo
        for o, r in zip(got, ref):
            if isinstance(o, list):
                continue
            lps = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
            assert lps == pytest.approx([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]], abs=1e-4)
        assert info["retractions"] > 0 and info["spec_rows"] > 20, (algo, info)
        assert info["spec_accepted_tokens"] > 0, info
    # greedy rows with the target as its own draft model: every draft stands, retracted rows' too (their draft KV
    # is read again from the start); a draft pool out of step with the rows would lose some
    greedy = [{**p, "temperature": 0.0, "regex": None} for p in params]
    _, info = run(
        tiny,
        ids,
        greedy,
        speculative_algorithm="STANDALONE",
        speculative_num_draft_tokens=4,
        **drafters["STANDALONE"],
        **pressure,
    )
    assert info["retractions"] > 0 and info["spec_drafted_tokens"] > 30, info
    assert info["spec_accepted_tokens"] == info["spec_drafted_tokens"], info


def test_real_model_greedy_answers_are_unchanged(smollm2_path):
    """SmolLM2 (30 layers) drafting with its first 28 (part of the drafts stand), and with itself as the draft
    model (every draft stands: the ceiling); the answers of plain decoding either way."""
    from sgjax.engine.engine import Engine
    from tests.conftest import SMALL

    greedy = {"max_new_tokens": 24, "temperature": 0}
    spec = {"speculative_num_draft_tokens": 4}
    runs = {
        "plain": {},
        "SELF": {**spec, "speculative_algorithm": "SELF", "speculative_draft_layers": 28},
        "STANDALONE": {**spec, "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": smollm2_path},
    }
    outs, infos = {}, {}
    for name, kw in runs.items():
        with Engine(**SMALL, **kw) as eng:
            outs[name] = [o["output_ids"] for o in eng.generate(COPY_PROMPTS, greedy)]
            infos[name] = eng.get_server_info()
    assert outs["SELF"] == outs["plain"] and outs["STANDALONE"] == outs["plain"]
    assert infos["SELF"]["spec_accepted_tokens"] > 5 and infos["SELF"]["spec_accept_length"] > 1.2, infos["SELF"]
    ceiling = infos["STANDALONE"]
    assert ceiling["spec_drafted_tokens"] > 30 and ceiling["spec_accepted_tokens"] == ceiling["spec_drafted_tokens"]


def test_a_draft_model_must_share_the_vocabulary_and_run_on_one_device(tiny, tmp_path):
    cfg, _, _ = tiny
    small_vocab = write_hf(TINY_LLAMA, dummy(TINY_LLAMA), tmp_path / "other")
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        load_draft(ServerArgs(speculative_algorithm="STANDALONE"), cfg)
    with pytest.raises(ValueError, match="the draft's vocabulary \\(512 tokens\\) must be the target's \\(49152\\)"):
        load_draft(ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=small_vocab), cfg)
    args = ServerArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path=small_vocab, tp_size=2)
    with pytest.raises(ValueError, match="STANDALONE runs on one device"):
        load_draft(args, cfg)
    draft_cfg, plan, weights = load_draft(dataclasses.replace(args, tp_size=1), TINY_LLAMA)
    assert draft_cfg.num_layers == 2 and plan.dtype == "float32" and weights.embed.shape[0] == 512


def dummy(cfg):
    from sgjax.model.weights import dummy_weights

    return dummy_weights(cfg)


def test_draft_layers_default_to_half_and_must_leave_a_layer_out():
    deep = TINY_LLAMA.replace(num_layers=30)
    assert draft_layers(ServerArgs(), deep) == 15
    assert draft_layers(ServerArgs(speculative_draft_layers=28), deep) == 28
    assert draft_layers(ServerArgs(), TINY_LLAMA) == 1
    for bad in (30, -1):
        with pytest.raises(ValueError, match="speculative_draft_layers must be in \\[1, 29\\]"):
            draft_layers(ServerArgs(speculative_draft_layers=bad), deep)


def test_self_speculation_under_tensor_parallelism_equals_one_device(tiny):
    """TP=2 (CPU host devices): the drafts run over the sharded weights and pool, and the answers are one
    device's without speculation."""
    from tests.engine.conftest import tiny_engine

    ids = [[5, 9, 27, 101, 3] * 3, list(range(200, 231)), [7, 8, 9] * 5]
    greedy = {"max_new_tokens": 20, "temperature": 0}
    outs = []
    for kw in ({}, {"speculative_algorithm": "SELF", "speculative_num_draft_tokens": 4, "tp_size": 2}):
        with tiny_engine(tiny, kv_cache_dtype="float32", **kw) as eng:
            outs.append([o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=greedy)])
            info = eng.get_server_info()
    assert outs[0] == outs[1] and info["spec_rows"] > 10, info


EMBED_SCALE = 4.0


def test_sampled_tokens_follow_plain_samplings_distribution(tmp_path):
    """Rejection sampling's promise, checked as a distribution: on a 16-token vocabulary, 300 sampled requests under
    SELF speculation and 300 under plain decoding, with different seeds, give the same histogram of (position,
    token) by a chi-square two-sample test; drafts were accepted along the way, so the verify rows did the
    sampling. (A verify that keeps a draft it should reject fails: the model's next-token distribution depends on
    the token before.)"""
    from scipy.stats import chi2

    from sgjax.engine.engine import Engine
    from sgjax.model.weights import dummy_weights

    # a tied head over large embeddings: each token's distribution depends strongly on the token before it, so a
    # sample drawn after the wrong prefix shows in the histogram
    cfg = TINY_LLAMA.replace(vocab_size=16, tie_word_embeddings=True)
    weights = dummy_weights(cfg, seed=3)
    weights = dataclasses.replace(weights, embed=weights.embed * EMBED_SCALE)
    n, new = 300, 6
    prompt = [1, 2, 3, 4, 1, 2, 3]
    counts, accepted = [], 0
    for algo, first_seed in ((None, 0), ("SELF", 100_000)):
        spec = dict(speculative_algorithm=algo, speculative_num_draft_tokens=3, speculative_draft_layers=1)
        with Engine.from_weights(
            cfg,
            weights,
            max_total_tokens=4096,
            chunked_prefill_size=256,
            max_running_requests=32,
            **(spec if algo else {}),
        ) as eng:
            params = [
                {"max_new_tokens": new, "temperature": 1.5, "ignore_eos": True, "sampling_seed": first_seed + i}
                for i in range(n)
            ]
            outs = eng.generate(input_ids=[prompt] * n, sampling_params=params)
            if algo:
                accepted = eng.get_server_info()["spec_accepted_tokens"]
        table = np.zeros((new, cfg.vocab_size))
        for o in outs:
            for pos, t in enumerate(o["output_ids"]):
                table[pos, t] += 1
        counts.append(table[1:].reshape(-1))  # the first token comes from the prefill, not a verify row
    assert accepted > 100
    plain, spec = counts
    keep = plain + spec >= 10  # a chi-square cell needs a few expected counts
    plain, spec = plain[keep], spec[keep]
    stat = (((plain - spec) ** 2) / (plain + spec)).sum()  # equal sample sizes
    p = chi2.sf(stat, keep.sum() - 1)
    assert p > 1e-3, (stat, keep.sum(), p)
