"""How `select` picks a choice from per-token logprobs: pure functions, no backend.

Each method gets, per choice, the logprobs of the choice's tokens given the prompt (and the earlier tokens of the
choice). `unconditional_likelihood_normalized` also gets the logprobs of the same tokens given no prompt; as in
SGLang the first of those has no context at all and counts as 0.

- token_length_normalized (the paper's): the mean logprob per token.
- greedy_token_selection: compare the choices token by token and keep the best at each position; a choice that
  has ended is extended with its mean logprob. It does not favour long options whose later tokens are nearly
  certain once the first one is chosen (what users found token_length_normalized does).
- unconditional_likelihood_normalized: the mean of (conditional - unconditional) logprob per token, which
  discounts options that are likely whatever the question (a PMI-style calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    index: int
    meta_info: dict = field(default_factory=dict)


def _mean(values) -> float:
    return sum(values) / len(values)


def _check(choices, logprobs) -> None:
    if len(choices) != len(logprobs):
        raise ValueError(f"{len(choices)} choices but {len(logprobs)} logprob lists")
    for c, lps in zip(choices, logprobs):
        if not lps:
            raise ValueError(f"choice {c!r} has no scored tokens")


def argmax_first(values) -> int:
    """The first index of the largest value (ties go to the earlier choice, as in SGLang)."""
    return max(range(len(values)), key=values.__getitem__)


def token_length_normalized_scores(logprobs: list[list[float]]) -> list[float]:
    return [_mean(lps) for lps in logprobs]


def unconditional_normalized_scores(logprobs: list[list[float]],
                                    unconditional: list[list[float | None]]) -> list[float]:
    scores = []
    for cond, uncond in zip(logprobs, unconditional):
        if len(cond) != len(uncond):
            raise ValueError(f"{len(cond)} conditional but {len(uncond)} unconditional logprobs for one choice")
        scores.append(_mean([c - (u or 0.0) for c, u in zip(cond, uncond)]))
    return scores


def greedy_token_matrix(logprobs: list[list[float]]) -> list[list[float]]:
    """Choices x positions; a choice shorter than the longest is padded with its own mean logprob."""
    width = max(len(lps) for lps in logprobs)
    return [list(lps) + [_mean(lps)] * (width - len(lps)) for lps in logprobs]


def greedy_token_index(logprobs: list[list[float]]) -> int:
    matrix = greedy_token_matrix(logprobs)
    remaining = list(range(len(matrix)))
    for j in range(len(matrix[0])):
        best = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == best]
        if len(remaining) == 1:
            break
    return remaining[0]


class ChoicesMethod:
    """Base of the select methods: `method(choices, logprobs, unconditional)` -> ChoicesDecision."""

    name = "method"
    requires_unconditional_logprobs = False

    def __call__(self, choices, logprobs, unconditional=None) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self):
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def __call__(self, choices, logprobs, unconditional=None) -> ChoicesDecision:
        _check(choices, logprobs)
        scores = token_length_normalized_scores(logprobs)
        i = argmax_first(scores)
        return ChoicesDecision(choices[i], i, {"scores": scores, "token_logprobs": logprobs})


class GreedyTokenSelection(ChoicesMethod):
    name = "greedy_token_selection"

    def __call__(self, choices, logprobs, unconditional=None) -> ChoicesDecision:
        _check(choices, logprobs)
        i = greedy_token_index(logprobs)
        return ChoicesDecision(choices[i], i, {"greedy_logprob_matrix": greedy_token_matrix(logprobs),
                                               "token_logprobs": logprobs})


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def __call__(self, choices, logprobs, unconditional=None) -> ChoicesDecision:
        _check(choices, logprobs)
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' unconditional logprobs")
        scores = unconditional_normalized_scores(logprobs, unconditional)
        i = argmax_first(scores)
        return ChoicesDecision(choices[i], i, {"scores": scores, "token_logprobs": logprobs,
                                               "unconditional_token_logprobs": unconditional})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
