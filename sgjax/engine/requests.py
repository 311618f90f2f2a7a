"""From an API call to runtime requests: validation, tokenization, images, length limits, grammars, n copies.

Runs on the caller's thread (or a worker thread for `async_generate`), never on the engine loop: compiling a new
grammar takes a noticeable time, which the loop must not wait out. Every refusal is a `RequestError` (or
`SamplingParamsError`) whose `field` names what was
wrong in the engine's terms, so API layers can rename it without reading the message.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgjax.engine.limits import DEFAULT_MAX_NEW_TOKENS, bound
from sgjax.engine.params import SamplingParams, SamplingParamsError
from sgjax.engine.request import Req
from sgjax.errors import RequestError
from sgjax.fsm import GrammarCache, GrammarError, RegexError, from_tokenizer
from sgjax.model.config import ModelConfig


@dataclass(frozen=True)
class GenerateCall:
    """One `Engine.generate` / `async_generate` call's arguments (SGLang's names)."""

    prompt: Any = None  # a string or a list of strings
    sampling_params: Any = None  # a dict / SamplingParams, or one per prompt
    input_ids: Any = None  # a list of ids or a list of lists
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    stream: bool = False
    rid: Any = None  # a string, or one per prompt
    image_data: Any = None  # vision models: base64 images per prompt
    lora_path: Any = None  # a loaded LoRA adapter's name, or one per prompt (None: the base model)
    bootstrap: Any = None  # disaggregation: per prompt (prefill host, bootstrap port, room) or None


def copy_seed(params: SamplingParams, copy: int) -> int | None:
    """The seed of copy `copy` of a seeded request with n > 1 (seed + copy): the engine's n and the server's
    per-copy streams give the same tokens."""
    return None if params.seed is None else (params.seed32 + copy) % 2**31


def copy_rid(base: str | None, params: SamplingParams, copy: int) -> str | None:
    return base if base is None or params.n == 1 else f"{base}-{copy}"


def check_token_ids(ids, vocab: int, field: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{field} has token ids outside [0, {vocab}): {bad[:5]}", field)


def _prompt_list(prompt, input_ids) -> tuple[list, bool]:
    """Exactly one of a text / texts or ids / lists of ids, as a list, and whether it was a single prompt."""
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of prompt or input_ids", "prompt")
    single = isinstance(prompt, str) if prompt is not None else not (input_ids and isinstance(input_ids[0], list))
    given = prompt if prompt is not None else input_ids
    return ([given] if single else list(given)), single


class LiveIds:
    """The ids of live requests (made and not finished), from any thread: two live requests never share an id, so
    aborts and results find exactly one."""

    def __init__(self):
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, rids: list[str]) -> None:
        with self._lock:
            taken = next((rid for rid in rids if rid in self._ids), None)
            if taken is None and len(set(rids)) < len(rids):
                taken = next(rid for rid in rids if rids.count(rid) > 1)
            if taken is not None:
                raise RequestError(
                    f"rid: a request with id {taken!r} is already running (ids must be unique among live requests)",
                    "rid",
                )
            self._ids.update(rids)

    def release(self, rid: str) -> None:
        with self._lock:
            self._ids.discard(rid)


class RequestBuilder:
    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer,
        images,
        *,
        context_length: int,
        max_total_tokens: int,
        max_top_logprobs: int,
        eos_ids: frozenset,
        seed: int,
        grammar_cache_size: int,
        grammar_compile_timeout: float | None = None,
        grammars_on: bool = True,
        max_grammar_chars: int = bound("grammar_chars"),
        max_images: int = bound("image_data"),
        adapters=None,
    ):
        self.cfg, self.tokenizer, self.images = cfg, tokenizer, images
        self.context_length, self.max_total_tokens = context_length, max_total_tokens
        self.max_top_logprobs, self.eos_ids = max_top_logprobs, eos_ids
        self.grammars = GrammarCache(max_entries=grammar_cache_size, compile_timeout=grammar_compile_timeout)
        self._seeds = np.random.default_rng(seed)
        self._vocabulary = None
        self.grammars_on = grammars_on
        self.max_grammar_chars, self.max_images = max_grammar_chars, max_images
        self.live = LiveIds()  # ids of the requests built and not yet finished
        self.adapters = adapters  # engine/adapters.Adapters (LoRA), or None

    def build(self, call: GenerateCall) -> tuple[list[Req], bool]:
        """The requests of a call (prompts x n copies) and whether it was a single prompt. Their ids are live from
        here until `forget`: an id already live (or twice in the call) is refused."""
        prompt, input_ids = call.prompt, call.input_ids
        items, single = _prompt_list(prompt, input_ids)
        prompts, ids_list = (items, None) if prompt is not None else (None, items)
        count = len(items)
        sp = call.sampling_params
        params_list = sp if isinstance(sp, list) else [sp] * count
        if len(params_list) != count:
            raise RequestError(f"{count} prompts but {len(params_list)} sampling_params", "sampling_params")
        rids = call.rid if isinstance(call.rid, list) else [call.rid] * count
        images_list = self._images_per_prompt(call.image_data, single, count)
        adapters = self._adapters_per_prompt(call.lora_path, count)
        reqs = []
        for i in range(count):
            params = SamplingParams.from_dict(params_list[i])
            params.validate(self.cfg.vocab_size)
            if (params.stop or params.stop_regex) and self.tokenizer is None:
                raise RequestError("stop strings need a tokenizer; this engine has none (use stop_token_ids)", "stop")
            ids = self.prompt_ids(prompts[i] if prompts is not None else None, ids_list[i] if ids_list else None)
            images = None
            if images_list is not None and images_list[i] is not None:
                ids, images = self.images.prepare(ids, images_list[i], self.cfg.vocab_size, None if single else i)
            params = self._fit_length(params, ids)
            grammar = self.grammar(params)
            if grammar is not None:
                grammar.finish_counts()  # made here, on the caller's thread: the loop's masks read them
            lp_start = self._logprob_start(call, ids)
            base = rids[i] or uuid.uuid4().hex
            for j in range(params.n):
                seed = copy_seed(params, j)
                reqs.append(
                    Req(
                        rid=copy_rid(base, params, j),
                        input_ids=list(ids),
                        params=params,
                        seed=seed if seed is not None else int(self._seeds.integers(2**31)),
                        return_logprob=bool(call.return_logprob),
                        logprob_start_len=lp_start,
                        top_logprobs_num=int(call.top_logprobs_num or 0),
                        grammar=grammar,
                        images=images,
                        min_tokens_stops=self.min_tokens_stops(params),
                        adapter=adapters[i],
                        bootstrap=call.bootstrap[i] if call.bootstrap else None,
                        extra_key=adapters[i],  # an adapter's KV is its own (identity: reloaded is another key)
                    )
                )
        if call.stream and len(reqs) != 1:
            raise RequestError("stream=True takes one prompt with n == 1", "stream")
        self.live.claim([r.rid for r in reqs])
        return reqs, single

    def forget(self, req: Req) -> None:
        """A request finished: its id may be used again."""
        self.live.release(req.rid)

    def _adapters_per_prompt(self, lora_path, count: int) -> list:
        """Each prompt's LoRA adapter (model/lora.Adapter) or None; a name not loaded is a 400 naming lora_path."""
        names = list(lora_path) if isinstance(lora_path, (list, tuple)) else [lora_path] * count
        if len(names) != count:
            raise RequestError(f"lora_path: {count} prompts but {len(names)} adapter names", "lora_path")
        if self.adapters is None:
            if any(n not in (None, "") for n in names):
                raise RequestError(
                    "lora_path: this engine serves no LoRA adapters (start it with --enable-lora)", "lora_path"
                )
            return [None] * count
        return [self.adapters.resolve(n) for n in names]

    def _images_per_prompt(self, image_data, single: bool, count: int):
        if image_data is None:
            return None
        if self.images is None:
            raise RequestError(
                "image_data: this engine's model is text-only (load a LLaVA checkpoint directory for images)",
                "image_data",
            )
        images_list = [image_data] if single else list(image_data)
        if len(images_list) != count:
            raise RequestError(f"image_data: {count} prompts but {len(images_list)} image lists", "image_data")
        for images in images_list:
            if isinstance(images, (list, tuple)) and len(images) > self.max_images:
                raise RequestError(
                    f"image_data: {len(images)} images in one prompt; at most {self.max_images} "
                    "(max_images_per_request)",
                    "image_data",
                )
        return images_list

    def grammar(self, params: SamplingParams):
        """The compiled FSM of a regex / json_schema request (cached across requests), or None."""
        kinds = ("regex", "ebnf", "structural_tag", "json_schema")
        field = next((k for k in kinds if getattr(params, k) is not None), None)
        if field is None:
            return None
        if not self.grammars_on:
            raise RequestError("constrained decoding is off on this server (grammar_backend 'none')", field)
        value = getattr(params, field)
        size = len(value if isinstance(value, str) else json.dumps(value))
        if size > self.max_grammar_chars:
            raise SamplingParamsError(
                f"{field}: {size} characters; at most {self.max_grammar_chars} (max_grammar_chars)", field
            )
        if self.tokenizer is None:
            raise RequestError("regex and json_schema need a tokenizer; this engine has none", field)
        vocab = self.vocabulary()
        try:
            if params.regex is not None:
                return self.grammars.get_regex(params.regex, vocab)
            if params.ebnf is not None:
                return self.grammars.get_ebnf(params.ebnf, vocab)
            if params.structural_tag is not None:
                return self.grammars.get_structural_tag(params.structural_tag, vocab)
            return self.grammars.get_json_schema(params.json_schema, vocab)
        except (GrammarError, RegexError) as e:
            raise SamplingParamsError(f"{field}: {e}", field) from None
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            # An ill-typed keyword ({"anyOf": 3}, "maxLength": "x") trips the schema compiler before its own checks:
            # still the request's mistake, not the engine's.
            raise SamplingParamsError(f"json_schema: invalid schema ({type(e).__name__}: {e})", "json_schema") from None

    def vocabulary(self):
        """The grammars' view of the tokenizer (fsm/vocab.py), made on first use."""
        if self._vocabulary is None:
            self._vocabulary = from_tokenizer(self.tokenizer)
        return self._vocabulary

    def prompt_ids(self, text, ids) -> list[int]:
        """A prompt's token ids from its text or ids, checked (also for embeddings)."""
        if text is not None:
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer (skip_tokenizer_init): pass input_ids", "prompt")
            if not isinstance(text, str):
                raise RequestError(f"prompt must be a string, got {type(text).__name__}", "prompt")
            ids = self.tokenizer.encode(text)
        ids = [int(t) for t in ids]
        if not ids:
            raise RequestError("the prompt is empty (0 tokens)", "prompt")
        check_token_ids(ids, self.cfg.vocab_size, "input_ids")
        return ids

    def whole_prompts(self, prompt, input_ids) -> list[list[int]]:
        """The prompts of a readout call (embeddings, scores): one or a batch, as text or ids, each checked and
        short enough to prefill."""
        items, _ = _prompt_list(prompt, input_ids)
        ids = [self.prompt_ids(p, None) if prompt is not None else self.prompt_ids(None, p) for p in items]
        for x in ids:
            if len(x) >= self.context_length:
                raise RequestError(
                    f"the prompt has {len(x)} tokens; at most {self.context_length - 1} fit (context_length)", "prompt"
                )
        return ids

    def _fit_length(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """Refuse prompts that cannot fit, and an explicit max_new_tokens that does not fit beside its prompt (as
        SGLang's and vLLM's servers do); shorten the default to fit. Returns params with max_new_tokens set."""
        limit = min(self.context_length, self.max_total_tokens)
        sizes = f"context_length {self.context_length}, max_total_tokens {self.max_total_tokens}"
        if len(ids) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} ({sizes})", "prompt"
            )
        asked = params.max_new_tokens
        if asked is None:
            most = min(DEFAULT_MAX_NEW_TOKENS, limit - len(ids))
            if params.min_new_tokens > most:
                raise SamplingParamsError(
                    f"min_new_tokens: {params.min_new_tokens} new tokens do not fit beside the prompt's {len(ids)} "
                    f"({sizes})",
                    "min_new_tokens",
                )
            return dataclasses.replace(params, max_new_tokens=most)
        if len(ids) + asked > limit:
            raise SamplingParamsError(
                f"max_new_tokens: {asked} new tokens plus the prompt's {len(ids)} exceed the limit of {limit} "
                f"tokens ({sizes})",
                "max_new_tokens",
            )
        return params

    def _logprob_start(self, call: GenerateCall, ids) -> int:
        top, start = call.top_logprobs_num, call.logprob_start_len
        if top is not None and (not isinstance(top, int) or top < 0 or top > self.max_top_logprobs):
            raise RequestError(
                f"top_logprobs_num must be an int in [0, {self.max_top_logprobs}], got {top!r}", "top_logprobs_num"
            )
        if start is None or not call.return_logprob:
            return -1
        if not isinstance(start, int) or start < -1 or start >= len(ids):
            raise RequestError(
                f"logprob_start_len must be -1 or in [0, {len(ids)}) for this prompt, got {start!r}",
                "logprob_start_len",
            )
        return start

    def min_tokens_stops(self, p: SamplingParams) -> tuple:
        """What the sampler masks while a request is short of min_new_tokens: the tokens that would stop it."""
        if not p.min_new_tokens:
            return ()
        return tuple(sorted((set() if p.ignore_eos else set(self.eos_ids)) | set(p.stop_token_ids)))


def asks_for_grammar(sampling_params) -> bool:
    """Whether a call's parameters (a dict / SamplingParams, or a list of them) constrain decoding: its requests are
    then built on the grammar workers (a compile can take seconds)."""
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for p in items:
        get = p.get if isinstance(p, dict) else (lambda k, p=p: getattr(p, k, None))
        if any(get(k) is not None for k in ("regex", "json_schema", "ebnf", "structural_tag")):
            return True
    return False
