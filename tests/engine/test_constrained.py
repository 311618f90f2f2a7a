"""regex / json_schema requests through the Engine with SmolLM2's vocabulary: outputs match, jump-forward changes
nothing but the number of steps, bad grammars are clear errors. The grammars only restrict what the model may pick,
so the tiny random model (the `tiny` fixture, SmolLM2's tokenizer) runs them; the real model's constrained outputs
are checked end to end by tests/lang and tests/server."""

import json
import re

import jsonschema
import pytest

from sgjax.engine.params import SamplingParamsError
from tests.engine.conftest import tiny_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "city", "skills", "address"],
}
PROMPT = (
    "<|im_start|>user\nDescribe a fictional person as JSON with name, age, city, skills and address."
    "<|im_end|>\n<|im_start|>assistant\n"
)
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def engines(tiny):
    with tiny_engine(tiny) as on, tiny_engine(tiny, disable_jump_forward=True) as off:
        yield on, off


def test_json_schema_output_validates_and_jump_forward_changes_only_the_step_count(engines):
    on, off = engines
    params = {"json_schema": json.dumps(PERSON), "max_new_tokens": 200, "temperature": 0}
    steps0 = off.get_server_info()["steps"]
    slow = off.generate(PROMPT, params)
    slow_steps = off.get_server_info()["steps"] - steps0
    steps0 = on.get_server_info()["steps"]
    fast = on.generate(PROMPT, params)
    fast_steps = on.get_server_info()["steps"] - steps0
    assert fast["output_ids"] == slow["output_ids"] and fast["text"] == slow["text"]
    jsonschema.validate(json.loads(fast["text"]), PERSON)
    assert fast["meta_info"]["finish_reason"]["type"] == "stop"
    assert on.get_server_info()["jump_forward_tokens"] >= 10
    assert fast_steps < slow_steps - 8, (fast_steps, slow_steps)


def test_forced_tokens_carry_the_logprobs_decoding_them_would_give(engines):
    """Jump-forward's forced tokens run through the model as an extend, whose rows give each forced token's logprob
    and top logprobs: finite, and equal (bit for bit: the CPU plan is batch-invariant) to the same tokens decoded
    one by one without jump-forward; the text and tokens are the same too."""
    on, off = engines
    params = {"json_schema": json.dumps(PERSON), "max_new_tokens": 200, "temperature": 0}
    fast = on.generate(PROMPT, params, return_logprob=True, top_logprobs_num=2)
    slow = off.generate(PROMPT, params, return_logprob=True, top_logprobs_num=2)
    assert fast["output_ids"] == slow["output_ids"] and fast["meta_info"]["finish_reason"]["type"] == "stop"
    got, want = fast["meta_info"], slow["meta_info"]
    assert len(got["output_token_logprobs"]) == len(fast["output_ids"])
    assert all(lp is not None and lp == lp for lp, _, _ in got["output_token_logprobs"])
    assert got["output_token_logprobs"] == want["output_token_logprobs"]
    assert got["output_top_logprobs"] == want["output_top_logprobs"]
    assert on.get_server_info()["jump_forward_tokens"] > 0


def test_a_prefill_only_request_reports_the_next_tokens_distribution(engines):
    """max_new_tokens 0 with top logprobs: output_top_logprobs holds the distribution after the prompt, once (as
    upstream SGLang reports it; its CoT-decoding example reads [0]); no output tokens."""
    on, _ = engines
    out = on.generate(PROMPT, {"max_new_tokens": 0}, return_logprob=True, top_logprobs_num=4)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    (tops,) = meta["output_top_logprobs"]
    assert len(tops) == 4 and [t[0] for t in tops] == sorted((t[0] for t in tops), reverse=True)
    first = on.generate(PROMPT, {"max_new_tokens": 1, "temperature": 0}, return_logprob=True, top_logprobs_num=4)
    assert first["meta_info"]["output_top_logprobs"][0] == tops  # what the first decoded token sees


def test_regex_outputs_fullmatch_greedy_and_sampled(engines):
    on, off = engines
    prompts = ["My phone number is ", "Call me at ", "The office number: "]
    greedy = on.generate(prompts, {"regex": PHONE, "max_new_tokens": 30, "temperature": 0})
    assert [g["text"] for g in greedy] == [
        o["text"] for o in off.generate(prompts, {"regex": PHONE, "max_new_tokens": 30, "temperature": 0})
    ]
    sampled = on.generate(
        prompts * 3, [{"regex": PHONE, "max_new_tokens": 30, "temperature": 1.0, "seed": i} for i in range(9)]
    )
    for out in greedy + sampled:
        assert re.fullmatch(PHONE, out["text"]), out["text"]
    yes_no = on.generate("Is the sky blue? Answer yes or no:", {"regex": "(yes|no)", "temperature": 0})
    assert yes_no["text"] in ("yes", "no")


def test_constrained_and_free_requests_share_a_batch(engines):
    on, _ = engines
    free = {"max_new_tokens": 10, "temperature": 0}
    alone = on.generate("The quick brown fox", free)
    mixed = on.generate(
        ["My phone number is ", "The quick brown fox", PROMPT],
        [
            {"regex": PHONE, "max_new_tokens": 30, "temperature": 0},
            free,
            {"json_schema": PERSON, "max_new_tokens": 200, "temperature": 0},
        ],
    )
    assert mixed[1]["output_ids"] == alone["output_ids"]
    assert re.fullmatch(PHONE, mixed[0]["text"])
    jsonschema.validate(json.loads(mixed[2]["text"]), PERSON)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"regex": "(unclosed"}, "regex"),
        (
            {
                "json_schema": {
                    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
                    "$ref": "#/$defs/n",
                }
            },
            "json_schema",
        ),
        ({"regex": "a", "json_schema": {"type": "string"}}, "regex"),
    ],
)
def test_bad_grammars_are_clear_errors_and_the_engine_keeps_serving(engines, params, field):
    on, _ = engines
    with pytest.raises(SamplingParamsError, match=field):
        on.generate("Hello", params)
    out = on.generate("My phone number is ", {"regex": PHONE, "max_new_tokens": 30, "temperature": 0})
    assert re.fullmatch(PHONE, out["text"])
