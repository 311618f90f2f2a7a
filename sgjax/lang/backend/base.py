"""The interface between the interpreter and a model.

The interpreter keeps each prompt state as text (and, for chat models, as messages) and asks a backend for four
things: generate a continuation (`generate`, `generate_stream`, and `speculate` for API speculative execution),
warm the prefix cache with a prompt (`cache_prefix`: the fork hint and the batch pre-cache), and pick one of several
continuations (`select`). Everything else (tokenization, the cache, batching) stays behind it. Implementations:
`EngineBackend` (the in-process Engine), `RuntimeEndpoint` (HTTP to `sgjax serve`), `OpenAI` (the official client,
against OpenAI or any OpenAI-compatible server).

A prompt is the state's text, or, for a backend with `is_chat_model`, the list of the state's finished messages
(`{"role", "content"}` dicts, OpenAI's format): a chat API answers with a new assistant message, so the interpreter
calls a chat backend only where the current assistant message is still empty (or, with API speculative execution,
matches the message's fixed text in the reply; see `sgjax/lang/speculative.py`).

`select` has a default built on two lower-level calls, `tokenize` and `prompt_logprobs`, so a backend that can
score prompts (the engine, the native HTTP server) only implements those; a backend that cannot (OpenAI) overrides
`select` itself.

Sampling parameters travel as a dict with SGLang's names (`max_new_tokens`, `stop`, `temperature`, `regex`,
`json_schema`, ... see `ir.GEN_PARAMS`), holding only what the program set; `return_logprob`,
`logprob_start_len` and `top_logprobs_num` ride along in the same dict.
"""

from __future__ import annotations

from typing import Callable, Iterator

from sgjax.lang.chat_template import PLAIN, ChatTemplate
from sgjax.lang.choices import ChoicesDecision, ChoicesMethod, token_length_normalized_scores

# What a gen generates at most when neither it nor the run sets max_tokens: SGLang's default and the Engine's.
# Backends whose API has another default (OpenAI completions: 16) send this one, so a program means the same
# everywhere, and API speculative execution knows where a gen would have stopped.
DEFAULT_MAX_NEW_TOKENS = 128


class Backend:
    chat_template: ChatTemplate = PLAIN
    is_chat_model = False  # True: prompts are message lists, answers whole assistant messages (OpenAI chat)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # -- what every backend implements -------------------------------------------------------------------
    def generate(self, prompt, params: dict) -> tuple[str, dict]:
        """Continue `prompt` (text, or messages for a chat model); returns the new text and the request's meta
        info (prompt_tokens, cached_tokens, completion_tokens, finish_reason: {"type": "stop" | "length", ...})."""
        raise NotImplementedError

    def generate_stream(self, prompt, params: dict) -> Iterator[tuple[str, dict]]:
        """Continue `prompt`, yielding (new piece, meta info so far); by default one piece."""
        yield self.generate(prompt, params)

    def speculate(self, prompt, params: dict) -> tuple[str, dict, list[int] | None]:
        """The call of API speculative execution (`params` has no stop strings and a larger max_new_tokens): the
        reply, its meta info, and the end offset in the reply of each output token, or None when the backend
        does not report tokens (then a gen answered from the reply cannot be checked against its max_tokens)."""
        text, meta = self.generate(prompt, params)
        return text, meta, None

    def cache_prefix(self, text: str, images: list[str] | None = None) -> dict:
        """Make `text` a cached prefix before requests that extend it arrive (a prefill-only request on a
        runtime with a prefix cache; nothing on one without). `images`: the text's images, one image token
        each, in order. Returns the request's meta info."""
        return {}

    def select(
        self, prompt, choices: list[str], method: ChoicesMethod, images: list[str] | None = None
    ) -> ChoicesDecision:
        """Pick one of `choices` as the continuation of `prompt` (with `images` at its image tokens)."""
        return select_by_prompt_logprobs(self, prompt, choices, method, images)

    # -- what the default select needs -------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} cannot tokenize; it must implement select itself")

    def token_text(self, token_id: int) -> str | None:
        """A token's text, for the [logprob, token_id, text] entries of select's meta info; None if unknown."""
        return None

    def prompt_logprobs(
        self, input_ids: list[list[int]], starts: list[int], images: list[str] | None = None
    ) -> list[list[float | None]]:
        """Prefill-only requests: for each prompt, the logprob of every token from position `starts[i]` on,
        given the tokens before it (None for position 0). A prefix already cached must be reused. `images`: the
        images of every prompt's image tokens, all of them before the starts."""
        raise NotImplementedError(f"{type(self).__name__} cannot score prompts; it must implement select itself")

    # -- runtime housekeeping ----------------------------------------------------------------------------
    def get_model_name(self) -> str | None:
        return None

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


def logprobs_by_start(
    input_ids: list[list[int]], starts: list[int], score: Callable[[list[list[int]], int], list[list[float | None]]]
) -> list[list[float | None]]:
    """`prompt_logprobs` for a runtime that takes one logprob_start_len per call: one batched `score(ids, start)`
    per distinct start, rows put back in the callers' order.

    Each row keeps its last len(ids) - start entries: a runtime that expands each image token into the vision
    tower's rows reports those rows too (its positions count them), and every image comes before the start."""
    rows: list = [None] * len(input_ids)
    for start in sorted(set(starts)):
        idx = [i for i, s in enumerate(starts) if s == start]
        for i, row in zip(idx, score([input_ids[i] for i in idx], start)):
            rows[i] = row[len(row) - (len(input_ids[i]) - start) :]
    return rows


def decoded_token_ends(tokenizer, output_ids: list[int], text: str) -> list[int]:
    """The end offset in `text` of each output token (for `speculate`): the length of the decoded prefix, clipped
    to the text."""
    ends, last = [], 0
    for k in range(1, len(output_ids) + 1):
        last = max(last, min(len(tokenizer.decode(output_ids[:k])), len(text)))
        ends.append(last)
    return ends


def select_by_prompt_logprobs(
    backend: Backend, text: str, choices: list[str], method: ChoicesMethod, images: list[str] | None = None
) -> ChoicesDecision:
    """Score each choice as a continuation of `text` with prompt logprobs over the cached prefix.

    The prefix is cached first (one prefill-only request), then every `text + choice` runs prefill-only with
    logprobs from the first token that differs from the prefix's own tokens, so only the choice's tokens are
    computed. Each choice is tokenized together with the text, as the model would see it later; where the
    choice merges with the text's last token (token healing), that merged token is scored as part of the choice.
    """
    media = {"images": images} if images else {}  # backends without image support keep their signatures
    prefix_ids = backend.tokenize(text)
    if prefix_ids:
        backend.cache_prefix(text, **media)
    full = [backend.tokenize(text + c) for c in choices]
    starts = [common_prefix_len(prefix_ids, ids) for ids in full]
    for c, ids, k in zip(choices, full, starts):
        if k >= len(ids):
            raise ValueError(f"select: choice {c!r} adds no tokens to the prompt")
    rows = backend.prompt_logprobs(full, starts, **media)
    # Position 0 has no logprob (an empty prompt before the choice): it is not scored.
    keep = [[j for j, lp in enumerate(row) if lp is not None] for row in rows]
    choice_ids = [ids[k:] for ids, k in zip(full, starts)]

    def entries(rows):  # SGLang's [logprob, token_id, text] per scored token
        return [
            [(row[j], ids[j], backend.token_text(ids[j])) for j in js] for row, js, ids in zip(rows, keep, choice_ids)
        ]

    unconditional = None
    if method.requires_unconditional_logprobs:
        rows_u = backend.prompt_logprobs(choice_ids, [0] * len(choice_ids))  # the choices alone: no image
        unconditional = entries(rows_u)
    conditional = entries(rows)
    # SGLang's keyword call, so a custom method written for SGLang works here too (choices.py)
    decision = method(
        choices=list(choices),
        normalized_prompt_logprobs=token_length_normalized_scores([[e[0] for e in row] for row in conditional]),
        input_token_logprobs=conditional,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )
    decision.meta_info["choice_token_ids"] = choice_ids
    return decision
