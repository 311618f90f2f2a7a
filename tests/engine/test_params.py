"""SamplingParams: every value SGLang's verify rejects (plus bad types, NaN, inf) fails at the door, naming its field.

The server returns these messages to clients as is, so each invalid case checks that the message names the field,
not just that something raised.
"""

import json
import math

import pytest

from sgjax.engine.params import SamplingParams, SamplingParamsError


def test_defaults_valid():
    p = SamplingParams()
    p.validate()
    p.validate(vocab_size=10)
    assert SamplingParams.from_dict(None) == p
    assert SamplingParams.from_dict({}) == p
    assert (
        p.max_new_tokens is None and p.top_k == -1 and p.stop == () and p.seed is None and p.seed32 is None
    )  # None: 128, fitted
    assert not p.is_greedy


def test_from_dict_returns_given_params():
    p = SamplingParams(temperature=0.5)
    assert SamplingParams.from_dict(p) is p
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams.from_dict(SamplingParams(temperature=-1.0))


def test_from_dict_values():
    p = SamplingParams.from_dict(
        {
            "max_new_tokens": 0,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.1,
            "frequency_penalty": -2,
            "presence_penalty": 2,
            "repetition_penalty": 2,
            "stop": ["a", "bc"],
            "stop_token_ids": [1, 2],
            "ignore_eos": True,
            "n": 3,
            "regex": "[a-z]+",
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
    )
    assert p.max_new_tokens == 0 and p.top_k == 40 and p.n == 3 and p.regex == "[a-z]+"
    assert p.stop == ("a", "bc") and p.stop_token_ids == (1, 2)
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert p.is_greedy
    hash(p)  # frozen and hashable: tuples, not lists


def test_none_means_default():
    p = SamplingParams.from_dict({"temperature": None, "stop": None, "max_new_tokens": None, "seed": None})
    assert p == SamplingParams()


def test_str_stop_becomes_tuple():
    assert SamplingParams.from_dict({"stop": "\n\n"}).stop == ("\n\n",)
    assert SamplingParams(stop="x").stop == ("x",)


def test_json_schema_dict_serialized():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams.from_dict({"json_schema": schema})
    assert isinstance(p.json_schema, str) and json.loads(p.json_schema) == schema
    assert SamplingParams.from_dict({"json_schema": json.dumps(schema)}).json_schema == p.json_schema


def test_sampling_seed_alias():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"seed": 7}).seed == 7
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})


def test_unknown_key_named():
    with pytest.raises(SamplingParamsError, match="'top_q'"):
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9})
    with pytest.raises(SamplingParamsError, match="sampling_params"):
        SamplingParams.from_dict([("temperature", 1.0)])


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, 2**31, -1, -(2**31), 2**63, -(2**100), 10**40])
def test_seed32_deterministic_in_range(seed):
    s = SamplingParams.from_dict({"seed": seed}).seed32
    assert isinstance(s, int) and 0 <= s < 2**31
    assert SamplingParams(seed=seed).seed32 == s
    if 0 <= seed < 2**31:
        assert s == seed


def test_seed32_spreads():
    assert len({SamplingParams(seed=-k).seed32 for k in range(1, 200)}) == 199


@pytest.mark.parametrize(
    "kw,greedy",
    [
        ({}, False),
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-7}, True),
        ({"temperature": 1e-5}, False),
        ({"top_k": 1}, True),
        ({"top_k": 2}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
    ],
)
def test_is_greedy(kw, greedy):
    assert SamplingParams.from_dict(kw).is_greedy is greedy


INVALID = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": -1e-9}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -math.inf}, "min_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "5"}, "top_k"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": "10"}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 20, "max_new_tokens": 10}, "min_new_tokens"),
    ({"min_new_tokens": 0.5}, "min_new_tokens"),
    ({"n": 0}, "n must"),
    ({"n": 2.0}, "n must"),
    ({"seed": 1.5}, "seed"),
    ({"sampling_seed": "abc"}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"regex": 5}, "regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": 5}, "json_schema"),
    ({"regex": "a+", "json_schema": "{}"}, "regex and json_schema"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"no_stop_trim": 1}, "no_stop_trim"),
    ({"spaces_between_special_tokens": None, "no_stop_trim": "no"}, "no_stop_trim"),
]


@pytest.mark.parametrize("d,field", INVALID, ids=[f"{k}" for k, _ in INVALID])
def test_invalid_rejected_naming_field(d, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict(d)
    assert field in str(e.value)
    assert isinstance(e.value, ValueError)


def test_message_format():
    with pytest.raises(SamplingParamsError, match=r"^temperature must be >= 0, got -1"):
        SamplingParams.from_dict({"temperature": -1})


@pytest.mark.parametrize(
    "d",
    [
        {"top_p": 1},
        {"top_p": 1e-9},
        {"min_p": 0},
        {"min_p": 1},
        {"top_k": -1},
        {"frequency_penalty": 2},
        {"presence_penalty": -2},
        {"repetition_penalty": 2},
        {"min_new_tokens": 5, "max_new_tokens": 5},
        {"max_new_tokens": 0},
        {"json_schema": "true"},
        {"seed": -5},
    ],
)
def test_boundaries_accepted(d):
    SamplingParams.from_dict(d)


def test_stop_token_ids_vocab_bound():
    p = SamplingParams.from_dict({"stop_token_ids": [0, 9]})
    p.validate(vocab_size=10)
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        p.validate(vocab_size=9)
