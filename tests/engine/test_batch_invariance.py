"""The same request gets the same greedy answer whatever else shares its steps (engine/plan.py `batch_invariant`):
on the defaults users get (auto: on this CPU the GGUF's int4 blocks, a bf16 pool, the native kernel), probe prompts
run alone and inside a batch of other requests of other lengths give identical tokens and logprobs, in process and
through `sgjax serve` under concurrent requests; and an explicit float32 run gives HF transformers' greedy tokens."""

import concurrent.futures

import pytest

from sgjax.engine.engine import Engine
from tests.conftest import SMALL, hf_generate_greedy

PROBES = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "In machine learning, a transformer is a model that",
]
OTHERS = ["Write a long story about a dragon who " + "likes to eat apples " * i for i in range(1, 9)]
GREEDY = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
LONGER = {"max_new_tokens": 40, "temperature": 0}


def _tokens_and_logprobs(out):
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def engine():
    with Engine(**SMALL) as eng:  # no setting pinned: what a user gets
        yield eng


def test_default_plan_is_batch_invariant_and_says_so(engine):
    plan = engine.get_server_info()["step_plan"]
    assert plan["batch_invariant"] == engine.plan.batch_invariant
    if engine.plan.matmul == "native":  # every CPU this project's CI runs on
        assert plan["batch_invariant"] and plan["attention"] == "cpu"


def test_probes_alone_and_inside_a_batch_of_others_give_the_same_tokens(engine):
    alone = [_tokens_and_logprobs(engine.generate(p, GREEDY, return_logprob=True)) for p in PROBES]
    engine.flush_cache()
    batch = engine.generate(
        OTHERS[:4] + PROBES + OTHERS[4:], [LONGER] * 4 + [GREEDY] * 4 + [LONGER] * 4, return_logprob=True
    )
    inside = [_tokens_and_logprobs(out) for out in batch[4:8]]
    for probe, a, b in zip(PROBES, alone, inside):
        assert len(a[0]) == 32
        assert a == b, probe  # tokens and every logprob, bit for bit
    # and again with the probes' prompts cached from the batch: prefix hits change nothing either
    again = [_tokens_and_logprobs(engine.generate(p, GREEDY, return_logprob=True)) for p in PROBES]
    assert again == alone


def test_through_sgjax_serve_concurrent_requests_change_no_answer(client):
    """The session's `sgjax serve` (tests/conftest.py: the defaults): each probe alone, then all of them sent at once
    beside the other requests from 12 client threads."""

    def ask(prompt, params):
        r = client.post("/generate", json={"text": prompt, "sampling_params": params, "return_logprob": True})
        assert r.status_code == 200, r.text
        return _tokens_and_logprobs(r.json())

    assert client.post("/flush_cache").json()["success"]
    alone = [ask(p, GREEDY) for p in PROBES]
    assert client.post("/flush_cache").json()["success"]
    jobs = [(p, LONGER) for p in OTHERS[:4]] + [(p, GREEDY) for p in PROBES] + [(p, LONGER) for p in OTHERS[4:]]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(*job), jobs))
    assert answers[4:8] == alone


def test_explicit_float32_gives_hfs_greedy_tokens(smollm2, hf_smollm2):
    """`Engine(dtype="float32")` runs float32 matrices and a float32 pool (auto would narrow them here) and gives
    HF transformers' float32 greedy tokens on six varied prompts for 24 tokens."""
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "<|im_start|>user\nName three fruits.<|im_end|>\n<|im_start|>assistant\n",
        "Water boils at",
        "The quick brown fox",
    ]
    tok = smollm2[2]
    with Engine(**SMALL, dtype="float32") as eng:
        assert (eng.plan.weight_dtype, eng.plan.kv_dtype, eng.plan.dtype) == ("float32",) * 3
        outs = eng.generate(prompts, {"max_new_tokens": 24, "temperature": 0})  # both stop at EOS, included
    want = hf_generate_greedy(hf_smollm2, [tok.encode(p) for p in prompts], 24)
    for prompt, out, ref in zip(prompts, outs, want):
        assert out["output_ids"] == ref, prompt
