"""min_new_tokens: the sampler masks the stop tokens until enough tokens exist (as SGLang and HF do)."""

import pytest

from sgjax.engine.engine import Engine
from sgjax.engine.params import SamplingParams
from tests.conftest import SMALL
from tests.engine.conftest import CHAT

PROMPT = CHAT + "Say hello.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(smollm2):
    with Engine(**SMALL, dtype="float32") as eng:  # HF parity
        yield eng


def _greedy(engine, **params):
    out = engine.generate(PROMPT, {"temperature": 0, **params})
    return out["output_ids"], out["meta_info"]


def test_min_new_tokens_masks_eos_and_matches_hf(engine, hf_smollm2):
    import torch

    free, meta = _greedy(engine, max_new_tokens=32)
    assert meta["finish_reason"]["type"] == "stop" and free[-1] in engine.eos_ids  # the model stops early
    k = len(free) + 4
    ids, meta = _greedy(engine, max_new_tokens=k + 4, min_new_tokens=k)
    assert len(ids) > k and not set(ids[:k]) & engine.eos_ids
    assert ids[: len(free) - 1] == free[:-1]  # only the stop was forbidden
    prompt = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        hf = hf_smollm2.generate(
            torch.tensor([prompt]),
            max_new_tokens=k + 4,
            min_new_tokens=k,
            do_sample=False,
            eos_token_id=sorted(engine.eos_ids),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    hf_ids = hf[0, len(prompt) :].tolist()
    assert ids == hf_ids[: len(ids)] and len(ids) == len(hf_ids)


def test_min_new_tokens_masks_stop_token_ids(engine):
    free, _ = _greedy(engine, max_new_tokens=6, ignore_eos=True)
    stop = free[1]
    ids, meta = _greedy(engine, max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop])
    assert ids == free[:2] and meta["finish_reason"]["matched"] == stop  # without min_new_tokens it stops there
    ids, meta = _greedy(engine, max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop], min_new_tokens=4)
    assert ids[0] == free[0] and stop not in ids[:4] and len(ids) >= 4


def test_ignore_eos_with_min_new_tokens_only_bans_listed_stops(engine):
    # With ignore_eos, EOS is an ordinary token: min_new_tokens must not mask it.
    assert engine.requests.min_tokens_stops(SamplingParams(min_new_tokens=2, ignore_eos=True)) == ()
    assert engine.requests.min_tokens_stops(SamplingParams(min_new_tokens=2, stop_token_ids=(7,), ignore_eos=True)) == (
        7,
    )
    assert set(engine.requests.min_tokens_stops(SamplingParams(min_new_tokens=2))) == set(engine.eos_ids)
    assert engine.requests.min_tokens_stops(SamplingParams()) == ()
