"""`OpenAI(model)`: programs run on OpenAI's API, or on any OpenAI-compatible server (`sgjax serve`'s `/v1`), through
the official `openai` client.

- A chat model (`is_chat_model`, the default except for OpenAI's completion models) gets the state's finished
  messages on `chat.completions` and answers with a new assistant message, so a gen must come first in its
  assistant message (the interpreter checks); a completion model gets the state's text on `completions`.
- Sampling parameters map to OpenAI's names (max_new_tokens -> max_tokens, sent always: 128 when the program sets
  none, as SGLang and the Engine default); SGLang's extras (top_k, min_p, repetition_penalty, min_tokens,
  ignore_eos, stop_token_ids, regex, and json_schema on completions) go in the request body for servers that take
  them (sgjax, SGLang; OpenAI refuses them). A chat gen's json_schema becomes `response_format`.
- `usage` counts calls and the API's own token usage (prompt, completion, cached), for API speculative execution's
  savings (`@sgl.function(num_api_spec_tokens=N)`, sgjax/lang/speculative.py). `speculate` asks for logprobs to
  learn where each output token ends, so speculated gens keep their max_tokens.
- select on a completion model scores every choice in one call: `prompt=[text + choice...]`, `echo=True`,
  `max_tokens=0`, `logprobs=0`; the tokens that cover the choice's characters are its tokens (as the default
  select, a token merging the text's end with the choice counts for the choice), and `choices_method` decides.
  `unconditional_likelihood_normalized` scores the choices alone in a second call; where a choice alone splits
  into other tokens than in context, its score is mean(conditional) - mean(unconditional).
- select on a chat model cannot score text (the API has no prompt logprobs): the model is asked (one call, greedy,
  the messages as they are) and its reply is matched: the choice it equals, else the longest choice it begins with
  (ignoring case and surrounding space), else the choice whose beginning is the likeliest first token among the
  reply's top logprobs. A reply that none of these finds is an error naming the reply. `choices_method` is not used.
"""

from __future__ import annotations

import codecs
import json
import os
import threading
from dataclasses import dataclass, field

from sgjax.engine.params import OPENAI_NAMES
from sgjax.lang.backend.base import DEFAULT_MAX_NEW_TOKENS, Backend
from sgjax.lang.chat_template import PLAIN, ChatTemplate
from sgjax.lang.choices import ChoicesDecision, ChoicesMethod

COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")  # OpenAI's non-chat models
# SGLang's names -> the OpenAI API's (engine/params.py's one table): the API's own fields, and SGLang's extensions,
# which go in extra_body for servers that take them (sgjax serve, SGLang). max_new_tokens is sent always.
_NATIVE = {
    ours: theirs for ours, (theirs, where) in OPENAI_NAMES.items() if where == "openai" and ours != "max_new_tokens"
}
_EXTRA = {ours: theirs for ours, (theirs, where) in OPENAI_NAMES.items() if where == "extra"}
_CHAT_SELECT_TOP_LOGPROBS = 10


@dataclass
class Usage:
    """What a backend's calls cost, from the API's own usage fields."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, usage) -> None:
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        with self._lock:
            self.calls += 1
            if usage is not None:
                self.prompt_tokens += usage.prompt_tokens or 0
                self.completion_tokens += usage.completion_tokens or 0
                self.cached_tokens += (getattr(details, "cached_tokens", None) or 0) if details else 0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "calls": self.calls,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens,
            }

    def reset(self) -> None:
        with self._lock:
            self.calls = self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0


class OpenAI(Backend):
    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool | None = None,
        chat_template: ChatTemplate | None = None,
        max_retries: int = 2,
        timeout: float | None = 600.0,
        **client_kwargs,
    ):
        import openai

        self._openai = openai
        if api_key is None:
            api_key = os.environ.get("OPENAI_API_KEY") or ("EMPTY" if base_url else None)
        self.client = openai.OpenAI(
            api_key=api_key, base_url=base_url, max_retries=max_retries, timeout=timeout, **client_kwargs
        )
        self.model_name = model_name
        self.is_chat_model = model_name not in COMPLETION_MODELS if is_chat_model is None else bool(is_chat_model)
        self.chat_template = chat_template or PLAIN
        self.usage = Usage()

    # -- calls -------------------------------------------------------------------------------------------------
    def _create(self, prompt, kwargs: dict, stream: bool = False):
        try:
            if self.is_chat_model:
                if not isinstance(prompt, list):
                    raise TypeError(f"a chat model takes a list of messages, not {type(prompt).__name__}")
                return self.client.chat.completions.create(
                    model=self.model_name, messages=prompt, stream=stream, **kwargs
                )
            return self.client.completions.create(model=self.model_name, prompt=prompt, stream=stream, **kwargs)
        except self._openai.APIConnectionError as e:
            raise ConnectionError(f"cannot reach the OpenAI API at {self.client.base_url}: {e}") from e

    def _call(self, prompt, kwargs: dict):
        resp = self._create(prompt, kwargs)
        self.usage.add(resp.usage)
        return resp

    def _kwargs(self, params: dict) -> dict:
        kwargs = {"max_tokens": params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)}
        extra = {}
        for name, value in params.items():
            if name in _NATIVE:
                kwargs[_NATIVE[name]] = value
            elif name in _EXTRA:
                extra[_EXTRA[name]] = value
            elif name == "json_schema":
                if self.is_chat_model:
                    kwargs["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "output", "schema": json.loads(value)},
                    }
                else:
                    extra["json_schema"] = value
            elif name == "return_logprob":
                if value:
                    kwargs.update(self._logprob_kwargs(params.get("top_logprobs_num") or 0))
            elif name == "logprob_start_len":
                raise ValueError("logprob_start_len: the OpenAI API returns no logprobs of the prompt")
            elif name == "image_data":  # only a completion model's prompt carries images this way
                raise ValueError("image: OpenAI's completions API takes text only; images need a chat model")
            elif name not in ("top_logprobs_num", "max_new_tokens", "return_text_in_logprobs"):  # texts: always
                raise ValueError(f"{name}: not a sampling parameter the OpenAI backend knows")
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _logprob_kwargs(self, top: int) -> dict:
        if self.is_chat_model:
            return {"logprobs": True, **({"top_logprobs": top} if top else {})}
        return {"logprobs": top}

    # -- Backend -----------------------------------------------------------------------------------------------
    def generate(self, prompt, params):
        resp = self._call(prompt, self._kwargs(params))
        choice = resp.choices[0]
        meta = _meta(resp, choice)
        if params.get("return_logprob"):
            meta["output_token_logprobs"] = [(lp, None, tok) for tok, lp, _ in self._token_logprobs(choice)]
        return _text(choice), meta

    def generate_stream(self, prompt, params):
        kwargs = {**self._kwargs(params), "stream_options": {"include_usage": True}}
        usage, meta = None, {}
        for chunk in self._create(prompt, kwargs, stream=True):
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if self.is_chat_model else choice.text) or ""
            if choice.finish_reason is not None:
                meta = {"id": chunk.id, "finish_reason": {"type": choice.finish_reason}}
            if piece:
                yield piece, meta
        self.usage.add(usage)
        if usage is not None:
            meta = {**meta, "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
        yield "", meta

    def speculate(self, prompt, params):
        resp = self._call(prompt, {**self._kwargs(params), **self._logprob_kwargs(0)})
        choice = resp.choices[0]
        text = _text(choice)
        tokens = self._token_logprobs(choice)
        return text, _meta(resp, choice), [end for _, _, end in tokens] if tokens else None

    def _token_logprobs(self, choice) -> list[tuple[str, float, int]]:
        """(token, logprob, end offset in the choice's text) of each output token; [] without logprobs."""
        lp = choice.logprobs
        if lp is None:
            return []
        if self.is_chat_model:
            out, end = [], 0
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            for t in lp.content or ():
                end += len(decoder.decode(bytes(t.bytes) if t.bytes is not None else t.token.encode()))
                out.append((t.token, t.logprob, end))
            return out
        return [(tok, lp_, off + len(tok)) for tok, lp_, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset)]

    def select(self, prompt, choices, method: ChoicesMethod, images=None) -> ChoicesDecision:
        if images:  # the interpreter sends a chat model's images inside its messages, never here
            raise ValueError("image: OpenAI's completions API takes text only; images need a chat model")
        if self.is_chat_model:
            return self._select_by_asking(prompt, choices)
        logprobs = self._choice_logprobs([prompt + c for c in choices], len(prompt))
        unconditional = None
        if method.requires_unconditional_logprobs:
            # Alone, a choice's first token has no context: None, which the method counts as 0 (as in SGLang).
            alone = self._choice_logprobs(list(choices), 0, first=True)
            unconditional = [
                u if len(u) == len(c) else [sum(x or 0.0 for x in u) / len(u)] * len(c) for c, u in zip(logprobs, alone)
            ]
        return method(list(choices), logprobs, unconditional)

    def _choice_logprobs(self, texts: list[str], start: int, first: bool = False) -> list[list[float | None]]:
        """Logprobs of the tokens covering texts[i][start:], one echo call for all. The first token of a text
        has none: left out, or kept as None with `first`."""
        resp = self._call(texts, {"max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0})
        rows = []
        for text, choice in zip(texts, sorted(resp.choices, key=lambda c: c.index)):
            row = [lp for _, lp, end in self._token_logprobs(choice) if end > start and (first or lp is not None)]
            if not row:
                raise ValueError(f"select: choice {text[start:]!r} adds no scored tokens to the prompt")
            rows.append(row)
        return rows

    def _select_by_asking(self, messages, choices) -> ChoicesDecision:
        longest = max(len(c) for c in choices)
        resp = self._call(
            messages,
            {"max_tokens": min(longest + 4, 64), "temperature": 0, **self._logprob_kwargs(_CHAT_SELECT_TOP_LOGPROBS)},
        )
        choice = resp.choices[0]
        reply = _text(choice)
        index, how = match_choice(reply, choices, _first_token_alternatives(choice))
        if index is None:
            raise ValueError(
                f"select: the chat model answered {reply!r}, which is none of {list(choices)}, and no "
                f"likely first token begins one; ask for one of the choices in the prompt"
            )
        return ChoicesDecision(choices[index], index, {"reply": reply, "matched_by": how})

    @property
    def token_usage(self) -> Usage:
        """SGLang's name for `usage` (its programs call `backend.token_usage.reset()` and read `.prompt_tokens`)."""
        return self.usage

    def get_model_name(self):
        return self.model_name

    def __repr__(self):
        return f"OpenAI({self.model_name!r}, base_url={str(self.client.base_url)!r})"


def match_choice(reply: str, choices, first_token: dict[str, float]) -> tuple[int | None, str]:
    """The choice a chat reply names: equal, else the longest it begins with (case and surrounding space ignored),
    else the one whose beginning is the likeliest of the first token's alternatives (token text -> logprob)."""
    if reply in choices:
        return list(choices).index(reply), "reply"
    said = reply.strip().lower()
    starts = [i for i, c in enumerate(choices) if c.strip() and said.startswith(c.strip().lower())]
    if starts:
        return max(starts, key=lambda i: len(choices[i].strip())), "reply"
    best, best_lp = None, None
    for token, lp in first_token.items():
        t = token.strip().lower()
        for i, c in enumerate(choices):
            if t and c.strip().lower().startswith(t) and (best_lp is None or lp > best_lp):
                best, best_lp = i, lp
    return best, "first_token_logprobs"


def _first_token_alternatives(choice) -> dict[str, float]:
    content = choice.logprobs.content if choice.logprobs is not None else None
    if not content:
        return {}
    first = content[0]
    return {**{t.token: t.logprob for t in first.top_logprobs or ()}, first.token: first.logprob}


def _text(choice) -> str:
    return (choice.message.content if hasattr(choice, "message") else choice.text) or ""


def _meta(resp, choice) -> dict:
    usage = resp.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "id": resp.id,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
        "finish_reason": {"type": choice.finish_reason, "matched": getattr(choice, "matched_stop", None)},
    }
