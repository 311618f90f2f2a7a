"""The interface between the interpreter and a model.

The interpreter keeps each prompt state as text and asks a backend for four things: generate a continuation
(`generate`, `generate_stream`), warm the prefix cache with a prompt (`cache_prefix`: the fork hint and the
batch pre-cache), and pick one of several continuations (`select`). Everything else (tokenization, the cache,
batching) stays behind it. Implementations: `EngineBackend` (the in-process Engine); `RuntimeEndpoint` (HTTP to
`sgjax serve`) and `OpenAI` (API speculative execution) come next and implement the same methods.

`select` has a default built on two lower-level calls, `tokenize` and `prompt_logprobs`, so a backend that can
score prompts (the engine, the native HTTP server) only implements those; a backend that cannot (OpenAI chat
models) overrides `select` itself.

Sampling parameters travel as a dict with SGLang's names (`max_new_tokens`, `stop`, `temperature`, `regex`,
`json_schema`, ... see `ir.GEN_PARAMS`), holding only what the program set; `return_logprob`,
`logprob_start_len` and `top_logprobs_num` ride along in the same dict.
"""

from __future__ import annotations

from typing import Iterator

from sgjax.lang.chat_template import PLAIN, ChatTemplate
from sgjax.lang.choices import ChoicesDecision, ChoicesMethod


class Backend:
    chat_template: ChatTemplate = PLAIN
    is_chat_model = False  # True: the model takes messages, not text (OpenAI chat), see docs/lang.md

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # -- what every backend implements -------------------------------------------------------------------
    def generate(self, text: str, params: dict) -> tuple[str, dict]:
        """Continue `text`; returns the new text and the request's meta info (cached_tokens, finish_reason...)."""
        raise NotImplementedError

    def generate_stream(self, text: str, params: dict) -> Iterator[tuple[str, dict]]:
        """Continue `text`, yielding (new piece, meta info so far); by default one piece."""
        yield self.generate(text, params)

    def cache_prefix(self, text: str) -> dict:
        """Make `text` a cached prefix before requests that extend it arrive (a prefill-only request on a
        runtime with a prefix cache; nothing on one without). Returns the request's meta info."""
        return {}

    def select(self, text: str, choices: list[str], method: ChoicesMethod) -> ChoicesDecision:
        """Pick one of `choices` as the continuation of `text`."""
        return select_by_prompt_logprobs(self, text, choices, method)

    # -- what the default select needs -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} cannot tokenize; it must implement select itself")

    def prompt_logprobs(self, input_ids: list[list[int]], starts: list[int]) -> list[list[float | None]]:
        """Prefill-only requests: for each prompt, the logprob of every token from position `starts[i]` on,
        given the tokens before it (None for position 0). A prefix already cached must be reused."""
        raise NotImplementedError(f"{type(self).__name__} cannot score prompts; it must implement select itself")

    # -- runtime housekeeping ----------------------------------------------------------------------------
    def get_server_info(self) -> dict:
        return {}

    def flush_cache(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def select_by_prompt_logprobs(backend: Backend, text: str, choices: list[str],
                              method: ChoicesMethod) -> ChoicesDecision:
    """Score each choice as a continuation of `text` with prompt logprobs over the cached prefix.

    The prefix is cached first (one prefill-only request), then every `text + choice` runs prefill-only with
    logprobs from the first token that differs from the prefix's own tokens, so only the choice's tokens are
    computed. Each choice is tokenized together with the text, as the model would see it later; where the
    choice merges with the text's last token (token healing), that merged token is scored as part of the choice.
    """
    prefix_ids = backend.tokenize(text)
    if prefix_ids:
        backend.cache_prefix(text)
    full = [backend.tokenize(text + c) for c in choices]
    starts = [common_prefix_len(prefix_ids, ids) for ids in full]
    for c, ids, k in zip(choices, full, starts):
        if k >= len(ids):
            raise ValueError(f"select: choice {c!r} adds no tokens to the prompt")
    rows = backend.prompt_logprobs(full, starts)
    # Position 0 has no logprob (an empty prompt before the choice): it is not scored.
    keep = [[j for j, lp in enumerate(row) if lp is not None] for row in rows]
    logprobs = [[row[j] for j in js] for row, js in zip(rows, keep)]
    unconditional = None
    if method.requires_unconditional_logprobs:
        alone = [ids[k:] for ids, k in zip(full, starts)]
        rows_u = backend.prompt_logprobs(alone, [0] * len(alone))
        unconditional = [[row[j] for j in js] for row, js in zip(rows_u, keep)]
    decision = method(list(choices), logprobs, unconditional)
    decision.meta_info["choice_token_ids"] = [ids[k:] for ids, k in zip(full, starts)]
    return decision
