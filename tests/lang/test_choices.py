"""The select methods as pure functions of per-token logprobs."""

import pytest

from sgjax.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
    unconditional_normalized_scores,
)

CHOICES = ["long option", "short"]


def test_token_length_normalized_takes_the_best_mean_and_the_first_on_ties():
    d = token_length_normalized(CHOICES, [[-0.1, -5.0], [-0.5]])
    assert (d.decision, d.index) == ("short", 1)
    assert d.meta_info["scores"] == pytest.approx([-2.55, -0.5])
    assert token_length_normalized(CHOICES, [[-1.0, -1.0], [-1.0]]).decision == "long option"


def test_greedy_token_selection_decides_at_the_first_differing_token():
    # The first token of the long option is the more likely: greedy picks it where the mean does not.
    assert greedy_token_selection(CHOICES, [[-0.1, -5.0], [-0.5]]).decision == "long option"
    # A shorter option continues with its own mean logprob: a tie everywhere keeps the first ...
    assert greedy_token_selection(CHOICES, [[-1.0, -1.0], [-1.0]]).decision == "long option"
    # ... and a worse second token of the longer option loses to the padded mean.
    d = greedy_token_selection(CHOICES, [[-1.0, -3.0], [-1.0]])
    assert d.decision == "short"
    assert d.meta_info["greedy_logprob_matrix"] == [[-1.0, -3.0], [-1.0, -1.0]]


def test_unconditional_likelihood_normalized_discounts_what_is_likely_anyway():
    cond = [[-1.0], [-2.0, -1.0]]
    uncond = [[None], [None, -3.0]]  # the first token has no context at all: it counts as 0
    assert unconditional_normalized_scores(cond, uncond) == pytest.approx([-1.0, 0.0])
    d = unconditional_likelihood_normalized(CHOICES, cond, uncond)
    assert d.decision == "short" and d.meta_info["unconditional_token_logprobs"] == uncond
    # The same logprobs without the calibration pick the other option.
    assert token_length_normalized(CHOICES, cond).decision == "long option"


@pytest.mark.parametrize(
    "args, match",
    [
        ((CHOICES, [[-1.0]]), "2 choices but 1"),
        ((CHOICES, [[-1.0], []]), "no scored tokens"),
    ],
)
def test_bad_inputs_are_clear_errors(args, match):
    for method in (token_length_normalized, greedy_token_selection):
        with pytest.raises(ValueError, match=match):
            method(*args)


def test_unconditional_method_needs_unconditional_logprobs():
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(CHOICES, [[-1.0], [-1.0]])
    with pytest.raises(ValueError, match="1 conditional but 2"):
        unconditional_likelihood_normalized(CHOICES, [[-1.0], [-1.0]], [[None, -1.0], [None]])


# SGLang's calling convention: keywords, [logprob, token_id, text] entries, the caller's normalized logprobs.
KEYWORDS = {
    "choices": ["cat", "catalog", "dog"],
    "normalized_prompt_logprobs": [-0.3, -0.4, -0.2],  # ranked as given (SGLang's select corrects them for healing)
    "input_token_logprobs": [
        [[-0.2, 10, "cat"]],
        [[-0.2, 10, "cat"], [-0.6, 11, "alog"]],
        [[-0.5, 12, "d"], [-0.05, 13, "og"]],
    ],
    "output_token_logprobs": [[], [], []],
    "unconditional_token_logprobs": [
        [[None, 10, "cat"]],
        [[None, 10, "cat"], [-2.0, 11, "alog"]],
        [[None, 12, "d"], [-0.05, 13, "og"]],
    ],
}


def test_the_methods_take_sglangs_keyword_call():
    d = token_length_normalized(**KEYWORDS)
    assert d.decision == "dog" and d.meta_info["scores"] == [-0.3, -0.4, -0.2]
    d = greedy_token_selection(**KEYWORDS)
    assert d.decision == "cat"  # ties with catalog on the first token, beats its -0.6 with its mean -0.2
    matrix = d.meta_info["greedy_logprob_matrix"]
    assert [row for row in matrix] == [[-0.2, -0.2], [-0.2, -0.6], [-0.5, -0.05]]
    d = unconditional_likelihood_normalized(**KEYWORDS)
    assert d.decision == "catalog"  # mean(-0.2 - 0, -0.6 + 2.0) = 0.6
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.2, 0.6, -0.25])
    for key in ("normalized_prompt_logprobs", "input_token_logprobs", "output_token_logprobs"):
        assert d.meta_info[key] == KEYWORDS[key]  # SGLang's meta info keys, as given
    assert d.meta_info["unconditional_token_logprobs"] == KEYWORDS["unconditional_token_logprobs"]


def test_the_short_call_reports_sglangs_keys_too():
    d = token_length_normalized(CHOICES, [[-0.1, -5.0], [-0.5]])
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-2.55, -0.5])
    assert d.meta_info["input_token_logprobs"] == [[(-0.1, None, None), (-5.0, None, None)], [(-0.5, None, None)]]
    assert d.meta_info["output_token_logprobs"] == [[], []]


def test_an_sglang_style_custom_method_gets_the_keyword_call_from_select():
    import sgjax as sgl
    from sgjax.lang.choices import ChoicesDecision, ChoicesSamplingMethod
    from tests.lang.fakes import FakeBackend

    seen = {}

    class LastToken(ChoicesSamplingMethod):  # written for SGLang: keyword-only, returns decision + meta_info
        def __call__(
            self,
            *,
            choices,
            normalized_prompt_logprobs,
            input_token_logprobs,
            output_token_logprobs,
            unconditional_token_logprobs=None,
        ):
            seen.update(input_token_logprobs=input_token_logprobs, normalized=normalized_prompt_logprobs)
            best = max(range(len(choices)), key=lambda i: input_token_logprobs[i][-1][0])
            return ChoicesDecision(decision=choices[best], meta_info={"by": "last token"})

    backend = FakeBackend(char_logprob=lambda context, ch: -1.0 if ch != "z" else -0.1)
    state = sgl.function(lambda s: s.__iadd__("A: " + sgl.select("x", ["ab", "az"], choices_method=LastToken()))).run(
        backend=backend
    )
    assert state["x"] == "az" and state.get_meta_info("x")["by"] == "last token"
    # one [logprob, token_id, text] entry per choice token (the fake tokenizes by character; no token texts)
    assert seen["input_token_logprobs"] == [
        [(-1.0, ord("a"), None), (-1.0, ord("b"), None)],
        [(-1.0, ord("a"), None), (-0.1, ord("z"), None)],
    ]
    assert seen["normalized"] == pytest.approx([-1.0, -0.55])
