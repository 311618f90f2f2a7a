"""`RuntimeEndpoint(url)`: programs run on an `sgjax serve` server (or SGLang's) over its native HTTP API.

Everything goes through `/generate`: gens (streamed as server-sent events with `stream=True`), the frontend hint and
the batch pre-cache (`max_new_tokens=0`), and select's scoring (`input_ids` with `return_logprob` and
`logprob_start_len`, so the server reuses the cached prefix and computes only the choices' tokens). Housekeeping is
`/get_server_info` and `/flush_cache`.

Tokens and role markers need the model's tokenizer on this side: the default select compares token ids of the
prompt with and without each choice, and the chat template gives the role markers. The server reports its model
file in `/get_model_info`; the endpoint loads the tokenizer from there (`tokenizer_path=` for a server whose files
are elsewhere), so the server needs no tokenize route and select costs no extra requests.
"""

from __future__ import annotations

import json
import os

import httpx

from sgjax.lang.backend.base import Backend, decoded_token_ends, logprobs_by_start
from sgjax.lang.chat_template import from_tokenizer
from sgjax.lang.ir import LOGPROB_PARAMS


class ServerError(RuntimeError):
    """The server refused a request (`status`: its HTTP status) or could not be reached (`status` None); the message
    names the URL and the server's reason."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RuntimeEndpoint(Backend):
    def __init__(
        self, base_url: str, api_key: str | None = None, tokenizer_path: str | None = None, timeout: float = 600.0
    ):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._request("GET", "/get_model_info")
        path = tokenizer_path or self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if not path or not os.path.exists(path):
            raise ValueError(
                f"RuntimeEndpoint({self.base_url!r}) needs the model's tokenizer (for select and the chat "
                f"template): the server reports {path!r}, which is not on this machine; pass "
                f"tokenizer_path= (a GGUF file or an HF model directory)"
            )
        from sgjax.model.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path)
        self.chat_template = from_tokenizer(self.tokenizer)

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None):
        try:
            r = self.client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise ServerError(
                f"cannot reach the server at {self.base_url}{path}: {type(e).__name__}: {e} "
                f"(is `sgjax serve` running there?)"
            ) from None
        if r.status_code != 200:
            raise ServerError(f"{self.base_url}{path} answered {r.status_code}: {_message(r.text)}", r.status_code)
        return r.json()

    def _generate(self, body: dict):
        return self._request("POST", "/generate", body)

    # -- Backend -----------------------------------------------------------------------------------------------
    def generate(self, text, params):
        out = self._generate(_body(text, params))
        return out["text"], out["meta_info"]

    def generate_stream(self, text, params):
        body = {**_body(text, params), "stream": True}
        sent = 0
        try:
            with self.client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    reason = _message(r.read().decode())
                    raise ServerError(f"{self.base_url}/generate answered {r.status_code}: {reason}", r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        raise ServerError(
                            f"{self.base_url}/generate failed while streaming: {event['error'].get('message')}"
                        )
                    piece = event["text"][sent:]
                    sent = len(event["text"])
                    yield piece, event["meta_info"]
        except httpx.TransportError as e:
            raise ServerError(f"cannot reach the server at {self.base_url}/generate: {type(e).__name__}: {e}") from None

    def speculate(self, text, params):
        out = self._generate(_body(text, params))
        return out["text"], out["meta_info"], decoded_token_ends(self.tokenizer, out["output_ids"], out["text"])

    def cache_prefix(self, text, images=None):
        body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
        return self._generate({**body, "image_data": images} if images else body)["meta_info"]

    def tokenize(self, text):
        return self.tokenizer.encode(text)

    def token_text(self, token_id):
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def get_model_name(self):
        return self.model_info.get("model_path")

    def prompt_logprobs(self, input_ids, starts, images=None):
        def score(ids, start):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": start,
            }
            outs = self._generate({**body, "image_data": [images] * len(ids)} if images else body)
            return [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]] for out in outs]

        return logprobs_by_start(input_ids, starts, score)

    def get_server_info(self):
        return self._request("GET", "/get_server_info")

    def flush_cache(self):
        try:
            return bool(self._request("POST", "/flush_cache").get("success"))
        except ServerError as e:
            if e.status == 400:  # requests are running: the server refuses, as SGLang's does
                return False
            raise

    def shutdown(self):
        self.client.close()

    def __repr__(self):
        return f"RuntimeEndpoint({self.base_url!r})"


def _body(text: str, params: dict) -> dict:
    """SGLang's /generate body: images ride beside the text as `image_data`, one per image token."""
    top = LOGPROB_PARAMS + ("image_data",)
    sampling = {k: v for k, v in params.items() if k not in top}
    return {"text": text, "sampling_params": sampling, **{k: v for k, v in params.items() if k in top}}


def _message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:500]
