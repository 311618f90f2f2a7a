"""SGLang's stop_regex: a Python regex searched in the output's tail after each token; the request stops with the
pattern as `matched`, its text kept whole (SGLang does not trim at a regex)."""

import re

import pytest

from sgjax.engine.detokenize import StopMatcher
from sgjax.engine.engine import Engine
from sgjax.engine.params import SamplingParams, SamplingParamsError
from tests.engine.test_engine import SMALL, assert_no_leak


def test_matcher_finds_a_regex_across_chunks_and_keeps_the_text():
    m = StopMatcher((), stop_regex=(r"\d{3}",))
    assert m.feed("ab1") == ("ab1", None) and m.feed("2") == ("2", None)
    assert m.feed("3x") == ("3x", r"\d{3}") and m.done and m.feed("more") == ("", None)
    both = StopMatcher(("zz",), stop_regex=("q+",))  # a string stop still trims, and holds its prefix back
    assert both.feed("a z") == ("a ", None) and both.feed("z!") == ("", "zz")


@pytest.mark.parametrize(
    "value, field",
    [
        ("(", "stop_regex"),
        (["a"] * 65, "stop_regex"),
        ("x" * 1025, "stop_regex"),
        (["ok", 3], "stop_regex"),
        (["a"] * 65, "stop"),
    ],
)
def test_bad_stops_are_refused_by_name(value, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.from_dict({field: value})
    assert e.value.field == field


def test_engine_stops_at_the_first_token_that_completes_a_match(smollm2):
    tok = smollm2[2]
    prompt = tok.encode("List the numbers from one to twenty in words, separated by commas:")
    with Engine(**SMALL) as eng:
        free = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0})
        text = free["text"]
        assert len(text) > 12, text
        pattern = re.escape(text[6:9]) + "|never-said-y"  # three characters in the middle, wherever tokens end
        out = eng.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 24, "temperature": 0, "stop_regex": [pattern, "never-said-x"]},
        )
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
        assert out["output_ids"] == free["output_ids"][: len(out["output_ids"])]
        assert re.search(pattern, out["text"]) and not re.search(pattern, tok.decode(out["output_ids"][:-1]))
        assert free["text"].startswith(out["text"])
        assert_no_leak(eng)
