"""Multi-LoRA serving: random HF PEFT adapters written with `peft` on a tiny Llama, served by name beside the base
model. Each request's greedy tokens and logprobs equal HF + PEFT's with the adapter merged; adapters of different
ranks and targets share a batch with the base model; more adapters than slots take turns; prefixes are never shared
between adapters; unknown names are refused by name."""

import copy

import numpy as np
import pytest
import torch

from sgjax.engine.engine import Engine
from sgjax.errors import RequestError
from sgjax.model import lora as lora_mod
from tests.model.hf_tiny import write_tiny

NEW = 10
# rank, alpha, targets, rslora: different ranks and targets, so the slots' padding and zero blocks are exercised
ADAPTERS = {
    "a": (4, 8, ["q_proj", "v_proj", "o_proj", "down_proj"], False),
    "b": (8, 4, ["k_proj", "gate_proj", "up_proj"], True),
    "c": (2, 2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base directory, {name: adapter directory}, {None | name: HF model with that adapter merged})."""
    from peft import LoraConfig, get_peft_model

    base_dir = str(tmp_path_factory.mktemp("lora-base"))
    base = write_tiny("llama-gqa4", base_dir)
    dirs, refs = {}, {None: base}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        conf = LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
        )
        peft_model = get_peft_model(copy.deepcopy(base), conf)
        with torch.no_grad():  # B large enough that every adapter changes the greedy tokens
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.5 * torch.randn_like(p))
        dirs[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        peft_model.save_pretrained(dirs[name])
        refs[name] = peft_model.merge_and_unload().eval()
    return base_dir, dirs, refs


def hf_reference(model, ids, n):
    """HF's greedy tokens and each one's logprob."""
    ids, tokens, lps = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            t = int(logp.argmax())
            tokens.append(t)
            lps.append(float(logp[t]))
            ids.append(t)
    return tokens, lps


PROMPTS = [[5, 17, 33, 48, 2, 99, 140, 7], [11, 12, 13, 14, 15, 16], [200, 3, 250, 9, 77, 31, 64, 128, 5]]
PARAMS = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(models):
    base_dir, dirs, _ = models
    with Engine(
        base_dir,
        dtype="float32",
        skip_tokenizer_init=True,
        page_size=4,
        max_total_tokens=512,
        chunked_prefill_size=32,
        max_running_requests=8,
        enable_lora=True,
        lora_paths=[f"a={dirs['a']}", f"b={dirs['b']}"],
        max_loras_per_batch=2,
        max_lora_rank=8,
        lora_target_modules=["all"],
    ) as eng:
        yield eng


def test_peft_directory_read_as_pefts_own_matrices(models):
    from safetensors.numpy import load_file

    from sgjax.model.loader import load_config

    base_dir, dirs, _ = models
    adapter = lora_mod.read_peft(dirs["b"], load_config(base_dir, "float32"), "b")
    assert (adapter.rank, adapter.modules) == (8, ("k_proj", "gate_proj", "up_proj"))
    raw = load_file(f"{dirs['b']}/adapter_model.safetensors")
    a = raw["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"]
    b = raw["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    np.testing.assert_array_equal(adapter.a["up_proj"][1], a.T)
    np.testing.assert_allclose(adapter.b["up_proj"][1], b.T * (4 / 8**0.5), rtol=1e-6)  # rslora: alpha / sqrt(r)


def test_mixed_batch_each_row_equals_its_merged_reference(engine, models):
    refs = models[2]
    names = [None, "a", "b"]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, lora_path=names, return_logprob=True)
    seen = set()
    for ids, name, out in zip(PROMPTS, names, outs):
        want, want_lps = hf_reference(refs[name], ids, NEW)
        assert out["output_ids"] == want, name
        got_lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        np.testing.assert_allclose(got_lps, want_lps, atol=1e-4)
        seen.add(tuple(want))
    # each adapter changes the answer: the test would see an adapter that was not applied
    assert len({tuple(hf_reference(refs[n], PROMPTS[0], NEW)[0]) for n in (None, "a", "b")}) == 3


def test_more_adapters_than_slots_take_turns_and_load_unload_by_name(engine, models):
    _, dirs, refs = models
    engine.load_lora_adapter("c", dirs["c"])
    assert set(engine.lora_adapters()) == {"a", "b", "c"}
    names = ["c", "a", "b", None, "c", "b"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    outs = engine.generate(input_ids=prompts, sampling_params=PARAMS, lora_path=names)
    for ids, name, out in zip(prompts, names, outs):
        assert out["output_ids"] == hf_reference(refs[name], ids, NEW)[0], name
    info = engine.get_server_info()
    assert info["lora_swaps"] >= 3 and len(info["lora_slots"]) == 2
    engine.unload_lora_adapter("c")
    with pytest.raises(RequestError) as e:
        engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS, lora_path="c")
    assert e.value.field == "lora_path"
    engine.check_invariants()


def test_prefixes_are_cached_per_adapter(engine):
    prompt = list(range(40, 64))  # six whole pages
    params = {**PARAMS, "max_new_tokens": 2}
    first = engine.generate(input_ids=prompt, sampling_params=params, lora_path="a")
    other = engine.generate(input_ids=prompt, sampling_params=params, lora_path="b")
    base = engine.generate(input_ids=prompt, sampling_params=params)
    again = engine.generate(input_ids=prompt, sampling_params=params, lora_path="a")
    assert first["meta_info"]["cached_tokens"] == 0
    assert other["meta_info"]["cached_tokens"] == 0  # a's KV is not b's
    assert base["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] >= 20


def test_unknown_adapters_and_engines_without_lora_refuse_by_name(engine, tiny):
    with pytest.raises(RequestError) as e:
        engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS, lora_path="nope")
    assert e.value.field == "lora_path" and "nope" in str(e.value)
    with pytest.raises(RequestError) as e:
        engine.load_lora_adapter("d", "/nonexistent")
    assert e.value.field == "lora_path"
    from tests.engine.conftest import tiny_engine

    with tiny_engine(tiny) as plain:
        with pytest.raises(RequestError) as e:
            plain.generate(input_ids=[1, 2, 3], sampling_params=PARAMS, lora_path="a")
        assert e.value.field == "lora_path" and "--enable-lora" in str(e.value)
        assert plain.generate(input_ids=[1, 2, 3], sampling_params=PARAMS, lora_path=None)["output_ids"]


def test_refused_at_start_by_name(models):
    base_dir, dirs, _ = models
    with pytest.raises(ValueError, match="speculative"):
        Engine(base_dir, skip_tokenizer_init=True, enable_lora=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="max-lora-rank"):
        Engine(base_dir, skip_tokenizer_init=True, lora_paths=[f"b={dirs['b']}"], max_lora_rank=4)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        Engine(base_dir, skip_tokenizer_init=True, max_lora_rank=4)
