"""The request bounds, one table: what one request may ask of the engine, the field a refusal names (a 400 at the
server, in the API's own name: max_new_tokens is max_tokens on the OpenAI routes), and the setting that moves a
bound where operators need one. Every check reads its bound here; docs/server.md ("Request bounds") lists them and
tests/server/test_bounds.py holds each to its 400.

Why bounds at all: a request is validated once, at the door, so that nothing inside the loop has to guard against
it; and no request may hold a slot, a page or a step's host time for longer than its answer needs (a
max_new_tokens of 2**63 once held a slot until the context filled).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_NEW_TOKENS = 128  # when a request does not say: SGLang's SamplingParams default, shortened to fit


@dataclass(frozen=True)
class Limit:
    field: str  # the engine's name of what is bounded (the API layer renames it)
    value: int | None  # the bound; None: it follows another setting (`setting`)
    setting: str | None  # the ServerArgs field (and `sgjax serve` flag) that sets it, where there is one
    rule: str  # what is refused, for the docs and the error


LIMITS: dict[str, Limit] = {
    limit.field: limit
    for limit in (
        Limit("prompt", None, "context_length", "a prompt of context_length (or max_total_tokens) tokens or more"),
        Limit(
            "max_new_tokens",
            None,
            "context_length",
            "an explicit max_new_tokens beyond what fits after the prompt; unset, it is 128 shortened to fit",
        ),
        Limit("n", 1024, None, "more than 1024 copies of one prompt"),
        Limit("stop", 64, None, "more than 64 stop strings (or stop regexes)"),
        Limit("stop_chars", 1024, None, "a stop string (or regex) of more than 1024 characters"),
        Limit("logit_bias", 1024, None, "more than 1024 biased tokens (each is a slot of the sampler's window)"),
        Limit("top_logprobs_num", 20, "max_top_logprobs_num", "more top logprobs per token than the setting"),
        Limit(
            "grammar_chars",
            65536,
            "max_grammar_chars",
            "a regex, JSON schema, EBNF grammar or structural tag longer than the setting, in characters",
        ),
        Limit("image_data", 16, "max_images_per_request", "more images in one prompt than the setting"),
    )
}


def bound(field: str) -> int:
    """The default bound of `field` (the setting's default where one sets it)."""
    value = LIMITS[field].value
    if value is None:
        raise KeyError(f"{field}'s bound follows {LIMITS[field].setting}")
    return value
