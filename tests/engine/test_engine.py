"""The Engine end to end on the real SmolLM2 (fp32, CPU): outputs against HF transformers, the cache's hits, memory
pressure, sampling, stops, streaming, logprobs and errors. What compares sgjax with itself (retraction against a
roomy pool, seeds across batches, compile counts, the pool's limits) runs on the tiny random model (`tiny`)."""

import asyncio
import threading
import time

import numpy as np
import pytest

from sgjax.cache import POLICIES
from sgjax.engine.engine import Engine
from sgjax.engine.params import SamplingParamsError
from sgjax.errors import RequestError
from tests.conftest import SMALL
from tests.engine.conftest import CHAT, FEW_SHOT, NEW_TOKENS, tiny_engine

GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def engine(smollm2):
    with Engine(**SMALL, dtype="float32") as eng:  # HF parity: float32 as asked, whatever auto would pick
        yield eng


@pytest.fixture(scope="module")
def tiny_eng(tiny):
    with tiny_engine(tiny) as eng:
        yield eng


def assert_no_leak(eng):
    info = eng.get_server_info()
    eng.check_invariants()
    assert info["running_requests"] == info["waiting_requests"] == 0
    assert info["protected_pages"] == 0
    assert info["free_pages"] + info["evictable_pages"] == info["num_pages"]


CONFIGS = [dict(schedule_policy=p) for p in POLICIES] + [dict(disable_radix_cache=True), dict(cache="table")]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_batch_equals_hf_under_every_policy_and_cache(config, prompt_ids, hf_greedy):
    with Engine(**SMALL, **config, dtype="float32") as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params=GREEDY)
        for i, (out, ref) in enumerate(zip(outs, hf_greedy)):
            assert out["output_ids"] == ref, f"prompt {i}"
        info = eng.get_server_info()
        if config.get("disable_radix_cache"):
            assert info["cached_tokens"] == 0
        elif config.get("schedule_policy", "lpm") in ("lpm", "dfs-weight") and config.get("cache") != "table":
            # The five few-shot prompts share ~60 tokens: the cache-aware orders defer the later ones a round so
            # that they hit the prefix the first one computes (fcfs and random admit them all at once).
            assert info["cached_tokens"] >= 4 * 48
        assert_no_leak(eng)


def expected_cached(previous: list[list[int]], ids: list[int], page: int = 16) -> int:
    """The cache oracle for sequential requests: the longest common prefix with anything computed before, in whole
    pages, never the whole prompt (its last token runs again for the logits)."""
    best = 0
    for seq in previous:
        n = min(len(seq), len(ids) - 1)
        a, b = np.asarray(seq[:n]), np.asarray(ids[:n])
        neq = np.nonzero(a != b)[0]
        best = max(best, int(neq[0]) if len(neq) else n)
    return best // page * page


def test_cached_tokens_for_the_papers_sharing_patterns(smollm2):
    tok = smollm2[2]
    with Engine(**SMALL) as eng:
        computed: list[list[int]] = []

        def run(ids, **params):
            out = eng.generate(input_ids=ids, sampling_params={"temperature": 0, **params})
            assert out["meta_info"]["cached_tokens"] == expected_cached(computed, ids)
            computed.append(ids + out["output_ids"][:-1])
            return out

        # Few-shot: every question after the first reuses the examples.
        for q in ("What do bees make?", "What is the opposite of hot?", "What do cows drink?"):
            out = run(tok.encode(FEW_SHOT + f"Q: {q}\nA:"), max_new_tokens=4)
        assert out["meta_info"]["cached_tokens"] >= 48
        # Multi-turn chat: turn 2 extends turn 1's prompt and answer.
        turn1 = CHAT + "Name a fruit.<|im_end|>\n<|im_start|>assistant\n"
        a1 = run(tok.encode(turn1), max_new_tokens=8)
        turn2 = tok.encode(turn1) + a1["output_ids"] + tok.encode("<|im_end|>\n<|im_start|>user\nAnother one.")
        out = run(turn2, max_new_tokens=4)
        assert out["meta_info"]["cached_tokens"] >= len(tok.encode(turn1)) // 16 * 16
        # Fork: the shared prefix goes first as a prefill-only request (the frontend hint), then the branches.
        prefix = tok.encode("Here are three ideas for a weekend trip, each in one sentence. Idea 1:" * 3)
        hint = run(prefix, max_new_tokens=0)
        assert hint["meta_info"]["completion_tokens"] == 0 and hint["meta_info"]["finish_reason"]["type"] == "length"
        branches = [prefix + tok.encode(f" Branch {i}: go hiking") for i in range(3)]
        outs = eng.generate(input_ids=branches, sampling_params={"temperature": 0, "max_new_tokens": 3})
        for out, ids in zip(outs, branches):
            assert out["meta_info"]["cached_tokens"] == expected_cached([prefix], ids) >= 32
        assert_no_leak(eng)


def test_small_pool_retracts_and_every_request_is_right(tiny, tiny_eng, prompt_ids):
    # The same model with room for every request is the reference.
    roomy = tiny_eng.generate(input_ids=prompt_ids, sampling_params=GREEDY)
    assert tiny_eng.get_server_info()["retractions"] == 0
    # 20 pages of 16 tokens: about three of these requests fit at once; no reserve for their outputs.
    with tiny_engine(
        tiny, max_total_tokens=320, chunked_prefill_size=64, max_running_requests=16, schedule_conservativeness=0.0
    ) as eng:
        outs = eng.generate(input_ids=prompt_ids, sampling_params=GREEDY)
        for i, (out, ref) in enumerate(zip(outs, roomy)):
            assert out["output_ids"] == ref["output_ids"], f"prompt {i}"
        info = eng.get_server_info()
        assert info["retractions"] > 0
        assert_no_leak(eng)


def test_seed_reproduces_sampling_whatever_the_batch(tiny_eng):
    params = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 1234}
    alone = tiny_eng.generate("Tell me about the ocean.", params)["output_ids"]
    mixed = tiny_eng.generate(
        ["Hi", "Tell me about the ocean.", "Once upon a time"], [GREEDY, params, {**params, "seed": 7}]
    )
    assert mixed[1]["output_ids"] == alone
    others = [tiny_eng.generate("Tell me about the ocean.", {**params, "seed": s})["output_ids"] for s in (1, 2, 3)]
    assert len({tuple(o) for o in others + [alone]}) > 1
    n3 = tiny_eng.generate("Tell me about the ocean.", {**params, "n": 3})
    assert len(n3) == 3 and n3[0]["output_ids"] == alone
    assert len({tuple(o["output_ids"]) for o in n3}) > 1


def test_penalties_change_the_output_and_keep_it_valid(engine):
    base = engine.generate("one one one one one", {"max_new_tokens": 8, "temperature": 0})
    pen = engine.generate(
        "one one one one one",
        {
            "max_new_tokens": 8,
            "temperature": 0,
            "repetition_penalty": 1.5,
            "frequency_penalty": 1.0,
            "presence_penalty": 1.0,
        },
    )
    assert base["output_ids"] != pen["output_ids"]
    assert pen["meta_info"]["completion_tokens"] == 8


def test_logit_bias_forces_and_bans_tokens(engine):
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    base = engine.generate("The capital of France is", greedy)["output_ids"]
    forced = engine.generate("The capital of France is", {**greedy, "logit_bias": {"42": 100}})["output_ids"]
    assert forced == [42] * 4
    banned = engine.generate("The capital of France is", {**greedy, "logit_bias": {str(base[0]): -100}})
    assert banned["output_ids"][0] != base[0]
    # beside penalties in one window, and in a batch with rows that have neither
    both = engine.generate(
        ["The capital of France is", "Hi"],
        [{**greedy, "frequency_penalty": 1.0, "logit_bias": {base[0]: -100, 7: 100}}, greedy],
    )
    assert both[0]["output_ids"] == [7] * 4
    assert both[1]["output_ids"] == engine.generate("Hi", greedy)["output_ids"]


def test_steady_state_compiles_nothing(tiny_eng, prompt_ids):
    def run(params):
        # The same cache state and all six requests queued before the first step, hence the same batches (the loop
        # could otherwise take the first request alone while the others are still being added: another shape).
        tiny_eng.flush_cache()
        tiny_eng.pause_generation("in_place")
        caller = threading.Thread(
            target=tiny_eng.generate, kwargs=dict(input_ids=prompt_ids[:6], sampling_params=params)
        )
        caller.start()
        deadline = time.monotonic() + 60
        while tiny_eng.queued_requests() < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        tiny_eng.continue_generation()
        caller.join(120)
        assert not caller.is_alive()

    run(GREEDY)
    traces = tiny_eng.get_server_info()["traces"]
    run(GREEDY)
    run({**GREEDY, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3})
    assert tiny_eng.get_server_info()["traces"] == traces


def test_stop_strings_tokens_eos_and_ignore_eos(engine):
    text = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 12, "temperature": 0})["text"]
    assert " 4, 5" in text
    out = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 12, "temperature": 0, "stop": [" 5,"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5,"}
    assert out["text"] == text[: text.index(" 5,")]
    kept = engine.generate(
        "Count: 1, 2, 3,", {"max_new_tokens": 12, "temperature": 0, "stop": [" 5,"], "no_stop_trim": True}
    )
    assert kept["text"].endswith(" 5,")
    first = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 12, "temperature": 0})["output_ids"]
    out = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [first[2]]})
    assert out["output_ids"] == first[:3] and out["meta_info"]["finish_reason"]["matched"] == first[2]
    chat = CHAT + "Say hello.<|im_end|>\n<|im_start|>assistant\n"
    ended = engine.generate(chat, {"max_new_tokens": 64, "temperature": 0})
    assert ended["meta_info"]["finish_reason"]["type"] == "stop"
    assert ended["output_ids"][-1] in engine.eos_ids and "<|im_end|>" not in ended["text"]
    longer = engine.generate(
        chat, {"max_new_tokens": len(ended["output_ids"]) + 3, "temperature": 0, "ignore_eos": True}
    )
    assert longer["meta_info"]["completion_tokens"] == len(ended["output_ids"]) + 3


def test_streaming_and_async(engine):
    full = engine.generate("The quick brown fox", GREEDY)
    chunks = list(engine.generate("The quick brown fox", GREEDY, stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full["text"] and chunks[-1]["meta_info"]["finish_reason"] is not None

    async def main():
        one = await engine.async_generate("The quick brown fox", GREEDY)
        streamed = [c async for c in await engine.async_generate("The quick brown fox", GREEDY, stream=True)]
        many = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in ["Hello", "Water boils at"]))
        return one, streamed, many

    one, streamed, many = asyncio.run(main())
    assert one["output_ids"] == full["output_ids"] and streamed[-1]["text"] == full["text"]
    assert [m["output_ids"] for m in many] == [
        o["output_ids"] for o in engine.generate(["Hello", "Water boils at"], GREEDY)
    ]


def test_logprobs_match_hf(engine, hf_smollm2, smollm2):
    import torch

    ids = smollm2[2].encode(FEW_SHOT + "Q: What do bees make?\nA:")
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 4, "temperature": 0},
        return_logprob=True,
        logprob_start_len=3,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([full])).logits[0].float(), -1).numpy()
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[3:]
    np.testing.assert_allclose([lp for lp, _, _ in inp], [ref[i - 1, ids[i]] for i in range(3, len(ids))], atol=2e-3)
    outp = meta["output_token_logprobs"]
    np.testing.assert_allclose(
        [lp for lp, _, _ in outp], [ref[len(ids) - 1 + j, t] for j, t in enumerate(out["output_ids"])], atol=2e-3
    )
    for row, tops in zip(range(len(ids) - 1, len(full) - 1), meta["output_top_logprobs"]):
        assert [t for _, t, _ in tops] == np.argsort(-ref[row])[:3].tolist()
    # Prompt logprobs from position 0 over a prefix that is already cached: the cache is not used past the start.
    again = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert again["meta_info"]["input_token_logprobs"][0][0] is None
    np.testing.assert_allclose(
        [lp for lp, _, _ in again["meta_info"]["input_token_logprobs"][1:]],
        [ref[i - 1, ids[i]] for i in range(1, len(ids))],
        atol=2e-3,
    )


def test_embeddings_are_hfs_normalized_last_hidden_state(engine, hf_smollm2, smollm2):
    import torch

    texts = ["The capital of France is Paris.", "Hello"]
    for text, got in zip(texts, engine.encode(texts)):
        with torch.no_grad():
            h = hf_smollm2.model(torch.tensor([smollm2[2].encode(text)])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(np.asarray(got), h / np.linalg.norm(h), atol=2e-4)


def test_score_is_hfs_next_token_probability_of_each_label(engine, hf_smollm2, smollm2):
    import torch

    tok = smollm2[2]
    query, items = "The capital of France is", [" Paris", " London", " a"]
    labels = [tok.encode(" the")[0], tok.encode(" and")[0], tok.encode(".")[0]]
    expected = []
    for item in items:
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([tok.encode(query + item)])).logits[0, -1]
        expected.append(torch.softmax(logits.double(), -1)[labels].numpy())
    np.testing.assert_allclose(engine.score(query, items, labels), expected, rtol=2e-3, atol=1e-6)
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([tok.encode("Paris is big.")])).logits[0, -1]
    np.testing.assert_allclose(
        engine.score(" is big.", ["Paris"], [labels], item_first=True)[0],
        torch.softmax(logits.double(), -1)[labels].numpy(),
        rtol=2e-3,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"nucleus": 0.5}, "nucleus"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),
        ({"logit_bias": {"one": 1}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_are_clear_errors_and_the_engine_keeps_serving(engine, params, field):
    with pytest.raises(SamplingParamsError, match=field):
        engine.generate("Hello", params)
    assert engine.generate("Hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[]), "empty"),
        (dict(input_ids=[1, 10**7]), "outside"),
        (dict(prompt="x", input_ids=[1]), "exactly one"),
        (dict(prompt="hi", return_logprob=True, logprob_start_len=99), "logprob_start_len"),
        (dict(prompt="hi", top_logprobs_num=1000), "top_logprobs_num"),
    ],
)
def test_bad_requests_are_clear_errors(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_too_long_prompt_and_max_new_tokens_are_refused_and_the_default_is_shortened(tiny):
    """A prompt that cannot fit and an explicit max_new_tokens beyond what fits beside it are refused, naming the
    field (as SGLang's and vLLM's servers refuse them); an unset max_new_tokens is 128 shortened to fit."""
    with Engine.from_weights(*tiny, max_total_tokens=64) as eng:
        with pytest.raises(RequestError, match="at most") as e:
            eng.generate(input_ids=[1] * 64)
        assert e.value.field == "prompt"
        with pytest.raises(RequestError, match="max_new_tokens: 100 new tokens plus the prompt's 60") as e:
            eng.generate(input_ids=[1] * 60, sampling_params={"max_new_tokens": 100, "ignore_eos": True})
        assert e.value.field == "max_new_tokens"
        with pytest.raises(RequestError, match="max_new_tokens") as e:
            eng.generate(input_ids=[1] * 3, sampling_params={"max_new_tokens": 2**63, "ignore_eos": True})
        out = eng.generate(input_ids=[1] * 60, sampling_params={"ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
        out = eng.generate(input_ids=[1] * 60, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4


def test_abort_frees_pages_at_once(engine):
    it = engine.generate("Once upon a time", {"max_new_tokens": 200, "ignore_eos": True}, stream=True)
    first = next(it)
    assert first["meta_info"]["finish_reason"] is None
    it.close()  # the client went away: the stream aborts its request
    info = engine.get_server_info()
    assert info["running_requests"] == 0
    assert_no_leak(engine)


def test_flush_cache(engine):
    engine.generate(FEW_SHOT + "Q: What do bees make?\nA:", GREEDY)
    assert engine.get_server_info()["evictable_pages"] > 0
    assert engine.flush_cache()
    info = engine.get_server_info()
    assert info["evictable_pages"] == 0 and info["free_pages"] == info["num_pages"]


def test_dummy_load_format_serves_text_with_the_directorys_config_and_tokenizer(smollm2, tmp_path):
    """load_format='dummy' (sgjax serve --load-format dummy): random weights of config.json's shapes, the
    directory's tokenizer; what the H200 serving benchmark runs when the weights cannot travel."""
    from sgjax.model.tokenizer import save_hf_dir

    _, _, tok = smollm2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "eos_token_id": list(tok.eos_token_ids),
    }
    save_hf_dir(tok, str(tmp_path), config)
    with Engine(str(tmp_path), load_format="dummy", max_total_tokens=1024) as eng:
        assert eng.model_config.num_layers == 2 and eng.model_config.hidden_size == 64
        out = eng.generate("Hello there", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 6 and isinstance(out["text"], str)
        assert out["meta_info"]["prompt_tokens"] == len(tok.encode("Hello there"))
    with pytest.raises(ValueError, match="load_format"):
        Engine(str(tmp_path), load_format="npz")
    with pytest.raises(ValueError, match="config.json"):
        Engine(None, load_format="dummy")
