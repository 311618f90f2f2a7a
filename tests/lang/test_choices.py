"""The select methods as pure functions of per-token logprobs."""

import pytest

from sgjax.lang.choices import (greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized,
                                unconditional_normalized_scores)

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


@pytest.mark.parametrize("args, match", [
    ((CHOICES, [[-1.0]]), "2 choices but 1"),
    ((CHOICES, [[-1.0], []]), "no scored tokens"),
])
def test_bad_inputs_are_clear_errors(args, match):
    for method in (token_length_normalized, greedy_token_selection):
        with pytest.raises(ValueError, match=match):
            method(*args)


def test_unconditional_method_needs_unconditional_logprobs():
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(CHOICES, [[-1.0], [-1.0]])
    with pytest.raises(ValueError, match="1 conditional but 2"):
        unconditional_likelihood_normalized(CHOICES, [[-1.0], [-1.0]], [[None, -1.0], [None]])
