"""SGLang-compatible sampling parameters, checked once at the door.

A request's parameters arrive as a JSON dict (SGLang's `sampling_params`) and are turned into a frozen
`SamplingParams` by `from_dict`, which rejects unknown keys and every value SGLang's `SamplingParams.verify`
rejects, plus wrong types, NaN and infinities. Every error is a `SamplingParamsError` (a ValueError) whose message
starts with the offending field's name, so the server can return it to the client as is and the scheduler never
sees a value it would have to guard against. `None` for a field means its default (OpenAI-style clients send
explicit nulls).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
from dataclasses import dataclass, fields
from typing import Any

from sgjax.engine.limits import DEFAULT_MAX_NEW_TOKENS, bound
from sgjax.errors import RequestError

_GREEDY_EPS = 1e-6
_ALIASES = {"sampling_seed": "seed"}
_ALIAS_OF = {v: k for k, v in _ALIASES.items()}
# Bounds (engine/limits.py, the one table): logit_bias entries are slots of the sampler's window (a compiled width);
# stop strings and regexes are checked on the host after every token, so one request cannot make every step slow.
MAX_LOGIT_BIAS = bound("logit_bias")
MAX_STOPS = bound("stop")
MAX_N = bound("n")  # copies of one prompt (the server also caps prompts x n per HTTP request)
MAX_STOP_CHARS = bound("stop_chars")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


# The one table of names between SGLang's sampling parameters and the OpenAI API's request fields: ours -> (theirs,
# "openai" for the API's own field, "extra" for SGLang's extensions, which OpenAI clients send in extra_body).
# json_schema has no row: chat requests carry it in response_format, completions as an extra `json_schema`.
OPENAI_NAMES: dict[str, tuple[str, str]] = {
    "max_new_tokens": ("max_tokens", "openai"),
    "min_new_tokens": ("min_tokens", "extra"),
    "stop": ("stop", "openai"),
    "stop_token_ids": ("stop_token_ids", "extra"),
    "stop_regex": ("stop_regex", "extra"),
    "temperature": ("temperature", "openai"),
    "top_p": ("top_p", "openai"),
    "top_k": ("top_k", "extra"),
    "min_p": ("min_p", "extra"),
    "frequency_penalty": ("frequency_penalty", "openai"),
    "presence_penalty": ("presence_penalty", "openai"),
    "repetition_penalty": ("repetition_penalty", "extra"),
    "ignore_eos": ("ignore_eos", "extra"),
    "skip_special_tokens": ("skip_special_tokens", "extra"),
    "no_stop_trim": ("no_stop_trim", "extra"),
    "regex": ("regex", "extra"),
    "ebnf": ("ebnf", "extra"),
    "n": ("n", "openai"),
    "seed": ("seed", "openai"),
    "logit_bias": ("logit_bias", "openai"),
}


def openai_name(name: str) -> str:
    return OPENAI_NAMES[name][0] if name in OPENAI_NAMES else name


class SamplingParamsError(RequestError):
    """A sampling parameter is invalid; `field` names it (the message starts with it too)."""

    def __init__(self, message: str, field: str):
        super().__init__(message, field)


@dataclass(frozen=True)
class SamplingParams:
    # 0: prefill only; None: not asked for, DEFAULT_MAX_NEW_TOKENS shortened to fit beside the prompt (an explicit
    # value that does not fit is refused: engine/requests.py)
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Python regexes searched in the tail of the decoded output after every token (SGLang's stop_regex); the text is
    # not trimmed at a regex match
    stop_regex: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None  # a JSON string; a dict is serialized
    ebnf: str | None = None  # SGLang's EBNF grammar (fsm/ebnf.py: recursion bounded, then a regex)
    structural_tag: str | None = None  # SGLang's structural tag, a JSON string (fsm/structural_tag.py); a dict is
    # serialized
    n: int = 1
    seed: int | None = None  # SGLang's sampling_seed
    # (token id, bias) pairs added to the logits after the penalties (OpenAI's / SGLang's logit_bias; a dict of
    # ids, as ints or the strings JSON keys are, to biases in [-100, 100])
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        # Normalize the shapes callers commonly pass; anything else is left for validate() to report.
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, ())
            elif isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        elif isinstance(self.stop_token_ids, (list, set, frozenset)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in _FLOAT_FIELDS:  # ints become floats; other types are left for validate() to report
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if isinstance(self.json_schema, (dict, list)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag))
        if self.logit_bias is None:
            object.__setattr__(self, "logit_bias", ())
        elif isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((_token_key(k), v) for k, v in self.logit_bias.items()))

    @classmethod
    def from_dict(cls, d: dict | SamplingParams | None) -> SamplingParams:
        """Parameters from SGLang's `sampling_params` dict (None: all defaults), validated."""
        if d is None:
            d = {}
        if isinstance(d, SamplingParams):
            d.validate()
            return d
        if not isinstance(d, dict):
            raise SamplingParamsError(f"sampling_params must be a dict, got {type(d).__name__}", "sampling_params")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name not in known:
                raise SamplingParamsError(f"{key!r} is not a known sampling parameter", key)
            if value is None:
                continue
            if name in kwargs:
                raise SamplingParamsError(f"{name} is given twice (as {name} and as {_ALIAS_OF[name]})", name)
            kwargs[name] = value
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first invalid field; `vocab_size` also bounds stop_token_ids."""
        for name in _FLOAT_FIELDS:
            _check_float(name, getattr(self, name))
        for name in ("top_k", "min_new_tokens", "n"):
            _check_int(name, getattr(self, name))
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a bool, got {getattr(self, name)!r}", name)

        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.top_k != -1 and self.top_k < 1:
            raise SamplingParamsError(f"top_k must be -1 (all tokens) or >= 1, got {self.top_k!r}", "top_k")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", name)
        if not 0 < self.repetition_penalty <= 2:
            raise SamplingParamsError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}", "repetition_penalty"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 0, got {self.max_new_tokens!r}", "max_new_tokens")
        most = self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        if not 0 <= self.min_new_tokens <= most:
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens={most}], got {self.min_new_tokens!r}", "min_new_tokens"
            )
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be in [1, {MAX_N}], got {self.n!r}", "n")
        if self.seed is not None:
            _check_int("seed", self.seed)

        for name in ("stop", "stop_regex"):
            self._validate_stops(name)
        if not isinstance(self.stop_token_ids, tuple):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}", "stop_token_ids"
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise SamplingParamsError(f"stop_token_ids must hold ints, got {t!r}", "stop_token_ids")
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise SamplingParamsError(f"stop_token_ids must hold ids in {bound}, got {t!r}", "stop_token_ids")

        self._validate_logit_bias(vocab_size)
        if self.regex is not None and not isinstance(self.regex, str):
            raise SamplingParamsError(f"regex must be a string, got {self.regex!r}", "regex")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                raise SamplingParamsError(
                    f"json_schema must be a JSON string or an object, got {self.json_schema!r}", "json_schema"
                )
            try:
                json.loads(self.json_schema)
            except ValueError as e:
                raise SamplingParamsError(f"json_schema is not valid JSON: {e}", "json_schema") from None
            except RecursionError:
                raise SamplingParamsError("json_schema is nested too deeply", "json_schema") from None
        if self.ebnf is not None and not isinstance(self.ebnf, str):
            raise SamplingParamsError(f"ebnf must be a string, got {self.ebnf!r}", "ebnf")
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            raise SamplingParamsError(
                f"structural_tag must be a JSON string or an object, got {self.structural_tag!r}", "structural_tag"
            )
        given = [n for n in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(self, n) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"{' and '.join(given)} are mutually exclusive: give at most one", given[0])

    def _validate_stops(self, name: str) -> None:
        stops = getattr(self, name)
        if not isinstance(stops, tuple):
            raise SamplingParamsError(f"{name} must be a string or a list of strings, got {stops!r}", name)
        if len(stops) > MAX_STOPS:
            raise SamplingParamsError(f"{name} takes at most {MAX_STOPS} entries, got {len(stops)}", name)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(f"{name} must hold non-empty strings, got {s!r}", name)
            if len(s) > MAX_STOP_CHARS:
                raise SamplingParamsError(
                    f"{name} entries take at most {MAX_STOP_CHARS} characters, got {len(s)}", name
                )
            if name == "stop_regex":
                try:
                    re.compile(s)
                except (re.error, RecursionError, OverflowError) as e:
                    raise SamplingParamsError(f"stop_regex {s[:80]!r} is not a valid regex: {e}", name) from None

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, tuple):
            raise SamplingParamsError(
                f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}", "logit_bias"
            )
        for entry in self.logit_bias:
            token, bias = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
            if (
                isinstance(token, bool)
                or not isinstance(token, numbers.Integral)
                or token < 0
                or (vocab_size is not None and token >= vocab_size)
            ):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise SamplingParamsError(f"logit_bias keys must be token ids in {bound}, got {token!r}", "logit_bias")
            _check_float("logit_bias", bias)
            if not -100 <= bias <= 100:
                raise SamplingParamsError(
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}", "logit_bias"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def seed32(self) -> int | None:
        """`seed` mapped deterministically into [0, 2**31) (identity there; a stable hash elsewhere)."""
        if self.seed is None:
            return None
        seed = int(self.seed)
        if 0 <= seed < 2**31:
            return seed
        raw = seed.to_bytes((seed.bit_length() + 8) // 8, "little", signed=True)
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") % 2**31


def _token_key(key):
    """A logit_bias key as an int token id where it is one (JSON object keys are strings); else left to validate."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key


def _check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(f"{name} must be a number, got {value!r}", name)
    if not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be finite, got {value!r}", name)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(f"{name} must be an int, got {value!r}", name)


def uses_penalties(p) -> bool:
    """Whether a request's sampling reads its token history (the sampler's penalty window)."""
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
