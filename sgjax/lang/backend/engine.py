"""The in-process backend: programs run on an `sgjax.Engine` in the same process, no HTTP in between.

`sgl.set_default_backend(engine)` wraps an Engine in `EngineBackend`; `sgl.Runtime(model_path, **server_args)`
starts an Engine that the backend owns and shuts down (SGLang's `Runtime` starts a server; ours does not need
one).
"""

from __future__ import annotations

from sgjax.errors import INTERNAL, SHUTDOWN, EngineError
from sgjax.lang.backend.base import Backend, decoded_token_ends, logprobs_by_start
from sgjax.lang.chat_template import from_tokenizer
from sgjax.lang.ir import LOGPROB_PARAMS


class EngineBackend(Backend):
    def __init__(self, engine):
        if engine.tokenizer is None:
            raise ValueError("the frontend works on text: this engine has no tokenizer (skip_tokenizer_init)")
        self.engine = engine
        self.chat_template = from_tokenizer(engine.tokenizer)

    def generate(self, text, params):
        sampling, extra, texts = _split(params)
        out = _served(self.engine.generate(text, sampling, **extra))
        return out["text"], self._with_texts(out["meta_info"], texts)

    def generate_stream(self, text, params):
        sampling, extra, texts = _split(params)
        sent = 0
        for chunk in self.engine.generate(text, sampling, stream=True, **extra):
            _served(chunk)
            piece = chunk["text"][sent:]
            sent = len(chunk["text"])
            yield piece, self._with_texts(chunk["meta_info"], texts)

    def token_text(self, token_id):
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _with_texts(self, meta: dict, texts: bool) -> dict:
        """return_text_in_logprobs (the server does it in native_api.with_token_text; the Engine leaves the text
        of its [logprob, token_id, text] entries None): each entry gets its token's text."""
        if not texts:
            return meta
        meta = dict(meta)
        fill = lambda row: [(lp, t, self.token_text(t)) for lp, t, _ in row]  # noqa: E731
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = fill(meta[key])
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = [None if row is None else fill(row) for row in meta[key]]
        return meta

    def get_model_name(self):
        return self.engine.args.model_path

    def speculate(self, text, params):
        sampling, extra, _ = _split(params)
        out = _served(self.engine.generate(text, sampling, **extra))
        return out["text"], out["meta_info"], decoded_token_ends(self.engine.tokenizer, out["output_ids"], out["text"])

    def cache_prefix(self, text, images=None):
        return _served(self.engine.generate(text, {"max_new_tokens": 0}, image_data=images or None))["meta_info"]

    def tokenize(self, text):
        return self.engine.tokenizer.encode(text)

    def prompt_logprobs(self, input_ids, starts, images=None):
        def score(ids, start):
            outs = self.engine.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=start,
                image_data=[images] * len(ids) if images else None,
            )
            return [[lp for lp, _, _ in _served(out)["meta_info"]["input_token_logprobs"]] for out in outs]

        return logprobs_by_start(input_ids, starts, score)

    def get_server_info(self):
        return self.engine.get_server_info()

    def flush_cache(self):
        return self.engine.flush_cache()


class Runtime(EngineBackend):
    """An Engine owned by the frontend: `sgl.set_default_backend(sgl.Runtime())` runs programs on SmolLM2."""

    def __init__(self, model_path: str | None = None, **server_args):
        from sgjax.engine.engine import Engine

        super().__init__(Engine(model_path, **server_args))

    @property
    def endpoint(self) -> "Runtime":
        """Upstream's Runtime keeps its backend here (its LLaVA example sets `runtime.endpoint.chat_template`); this
        Runtime is its own backend."""
        return self

    def shutdown(self):
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _served(out: dict) -> dict:
    """`out` unless the engine aborted it with a reason (an internal error, shutdown, a request that cannot fit):
    a program must fail there, naming the reason, not carry on with a cut text or with no logprobs to score."""
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort" and reason.get("message"):
        kind = SHUTDOWN if reason.get("status_code") == 503 else INTERNAL
        raise EngineError(f"the engine aborted the request: {reason['message']}", kind)
    return out


def _split(params: dict) -> tuple[dict, dict, bool]:
    """(sampling parameters, the other generate() arguments: logprob options and image_data, whether the logprob
    entries get their tokens' text)."""
    extra_names = LOGPROB_PARAMS + ("image_data",)
    sampling = {k: v for k, v in params.items() if k not in extra_names}
    extra = {k: v for k, v in params.items() if k in extra_names and k != "return_text_in_logprobs"}
    return sampling, extra, bool(params.get("return_text_in_logprobs"))
