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

A method takes sgjax's short form, `method(choices, logprobs, unconditional)` with lists of floats, or SGLang's
keywords, `method(choices=..., normalized_prompt_logprobs=..., input_token_logprobs=..., output_token_logprobs=...,
unconditional_token_logprobs=...)` with `[logprob, token_id, text]` entries (how SGLang's backends and tests call
it, and how sgjax's default select calls it, so an SGLang-style custom method works too). Either way the decision's
meta info has SGLang's keys (`normalized_prompt_logprobs`, `input_token_logprobs`, `output_token_logprobs`, and
per method `greedy_logprob_matrix` or `unconditional_token_logprobs` / `normalized_unconditional_prompt_logprobs`)
beside sgjax's (`scores`, `token_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChoicesDecision:
    decision: str
    index: int | None = None  # None where a method (SGLang's signature) gives only the decision
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


def unconditional_normalized_scores(
    logprobs: list[list[float]], unconditional: list[list[float | None]]
) -> list[float]:
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


def _values(rows) -> list[list]:
    """The logprobs of SGLang's [logprob, token_id, text] entries."""
    return [[entry[0] for entry in row] for row in rows]


def _entries(rows) -> list[list]:
    """Plain logprobs as SGLang's entries (no token id or text known)."""
    return [[(lp, None, None) for lp in row] for row in rows]


@dataclass
class ChoicesInput:
    """What a method decides on, from either calling convention."""

    choices: list
    logprobs: list  # [choice][token] float
    unconditional: list | None  # [choice][token] float or None (the first token alone has no context)
    normalized: list | None  # SGLang's normalized_prompt_logprobs when the caller gave them
    upstream: dict  # SGLang's meta info keys: normalized_prompt_logprobs, input/output_token_logprobs


class ChoicesMethod:
    """Base of the select methods: `method(choices, logprobs, unconditional)` or SGLang's keyword call
    (module docstring) -> ChoicesDecision. Subclasses implement `decide(ChoicesInput) -> (index, meta)`."""

    name = "method"
    requires_unconditional_logprobs = False

    def __call__(
        self,
        choices=None,
        logprobs=None,
        unconditional=None,
        *,
        normalized_prompt_logprobs=None,
        input_token_logprobs=None,
        output_token_logprobs=None,
        unconditional_token_logprobs=None,
    ) -> ChoicesDecision:
        choices = list(choices)
        if input_token_logprobs is not None:  # SGLang's convention
            logprobs = _values(input_token_logprobs)
            if unconditional_token_logprobs is not None:
                unconditional = _values(unconditional_token_logprobs)
        elif logprobs is None:
            raise TypeError(f"{self.name}: give the choices' logprobs (or SGLang's input_token_logprobs)")
        _check(choices, logprobs)
        means = token_length_normalized_scores(logprobs)
        upstream = {
            "normalized_prompt_logprobs": list(normalized_prompt_logprobs)
            if normalized_prompt_logprobs is not None
            else means,
            "input_token_logprobs": input_token_logprobs if input_token_logprobs is not None else _entries(logprobs),
            "output_token_logprobs": output_token_logprobs
            if output_token_logprobs is not None
            else [[] for _ in choices],
        }
        if unconditional_token_logprobs is not None:
            upstream["unconditional_token_logprobs"] = unconditional_token_logprobs
        i, meta = self.decide(ChoicesInput(choices, logprobs, unconditional, normalized_prompt_logprobs, upstream))
        return ChoicesDecision(choices[i], i, {**meta, **upstream, "token_logprobs": logprobs})

    def decide(self, x: ChoicesInput) -> tuple[int, dict]:
        raise NotImplementedError

    def __repr__(self):
        return self.name


# SGLang's name for the base class (custom methods subclass it).
ChoicesSamplingMethod = ChoicesMethod


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def decide(self, x):
        # SGLang's callers pass the normalized logprobs they computed (its select drops a healed token's logprob
        # there); the method ranks by them when given, as SGLang's does.
        scores = list(x.normalized) if x.normalized is not None else token_length_normalized_scores(x.logprobs)
        return argmax_first(scores), {"scores": scores}


class GreedyTokenSelection(ChoicesMethod):
    name = "greedy_token_selection"

    def decide(self, x):
        return greedy_token_index(x.logprobs), {"greedy_logprob_matrix": greedy_token_matrix(x.logprobs)}


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def decide(self, x):
        if x.unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the choices' unconditional logprobs")
        scores = unconditional_normalized_scores(x.logprobs, x.unconditional)
        return argmax_first(scores), {
            "scores": scores,
            "unconditional_token_logprobs": x.unconditional,
            "normalized_unconditional_prompt_logprobs": scores,
        }


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
