"""The routes that generate nothing: OpenAI's /v1/embeddings, SGLang's /v1/score, and SGLang's and vLLM's
/tokenize and /detokenize. Inputs are checked against the vocabulary before the engine sees them."""

from __future__ import annotations

import asyncio

from sgjax.engine.requests import check_token_ids
from sgjax.errors import RequestError
from sgjax.server import tools
from sgjax.server.openai_api import chat_messages, need_tokenizer
from sgjax.server.protocol import ApiError
from sgjax.server.serving import Serving, params_error


def _input_ids(serving: Serving, value, field: str) -> list[list[int]]:
    """A text, texts, ids or lists of ids as token ids, each checked against the vocabulary."""
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else list(value)
    if not items:
        raise ApiError(f"{field}: the batch is empty", param=field)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            need_tokenizer(serving)
            item = serving.tokenizer.encode(item)
        if not item:
            raise ApiError(f"{field}: input {i} is empty (0 tokens)", param=field)
        try:
            check_token_ids(item, serving.engine.model_config.vocab_size, field)
        except RequestError as e:
            raise params_error(e) from None
        out.append(list(item))
    return out


async def embeddings(serving: Serving, req) -> dict:
    ids = await asyncio.to_thread(_input_ids, serving, req.input, "input")
    hidden = serving.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise ApiError(
            f"dimensions: this model's embeddings have {hidden} dimensions, got {req.dimensions}", param="dimensions"
        )
    try:
        vectors = await asyncio.to_thread(serving.engine.encode, input_ids=ids)
    except RequestError as e:
        raise params_error(e, renames={"prompt": "input"}) from None
    if req.encoding_format == "base64":
        import base64

        import numpy as np

        vectors = [base64.b64encode(np.asarray(v, np.float32).tobytes()).decode() for v in vectors]
    tokens = sum(map(len, ids))
    return {
        "object": "list",
        "model": serving.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def score(serving: Serving, req) -> dict:
    """SGLang's /v1/score (engine/scoring.py has the rules)."""
    try:
        result = await asyncio.to_thread(
            serving.engine.score,
            req.query,
            req.items,
            req.label_token_ids,
            apply_softmax=req.apply_softmax,
            item_first=req.item_first,
            temperature=req.temperature,
            detail=True,
        )
    except RequestError as e:
        raise params_error(e, renames={"prompt": "items", "input_ids": "items"}) from None
    return {
        "object": "scoring",
        "model": serving.model_name,
        "scores": result.scores,
        "token_logprobs": result.logprobs if req.return_token_logprobs else None,
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": 0, "total_tokens": result.prompt_tokens},
    }


def tokenize(serving: Serving, req) -> dict:
    """SGLang's and vLLM's /tokenize: `text` or `prompt` (one or a list), or chat `messages` through the template."""
    need_tokenizer(serving)
    given = [n for n in ("text", "prompt", "messages") if getattr(req, n) is not None]
    if len(given) != 1:
        raise ApiError("prompt: give exactly one of text, prompt or messages", param="prompt")
    tok = serving.tokenizer
    if req.messages is not None:
        messages, images, _ = chat_messages(serving, req)
        if images:
            raise ApiError("messages: /tokenize takes text only", param="messages")
        messages, _ = tools.template_input(messages, tools.NO_TOOLS, serving.tool_format, tok.chat_template)
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt is not False)
        batch, single = [tok.encode(text)], True
    else:
        value = req.text if req.text is not None else req.prompt
        single = isinstance(value, str)
        texts = [value] if single else list(value)
        special = req.add_special_tokens is not False
        batch = [tok.encode(t, add_special_tokens=special) for t in texts]
    out = {
        "tokens": batch[0] if single else batch,
        "count": len(batch[0]) if single else [len(b) for b in batch],
        "max_model_len": serving.engine.context_length,
    }
    if req.return_token_strs:
        strs = [[serving.token_piece(t)[0] for t in ids] for ids in batch]
        out["token_strs"] = strs[0] if single else strs
    return out


def detokenize(serving: Serving, req) -> dict:
    need_tokenizer(serving)
    single = not (req.tokens and isinstance(req.tokens[0], list))
    batch = [req.tokens] if single else req.tokens
    for ids in batch:
        try:
            check_token_ids(ids, serving.engine.model_config.vocab_size, "tokens")
        except RequestError as e:
            raise params_error(e) from None
    texts = [serving.tokenizer.decode(ids, skip_special_tokens=False) for ids in batch]
    text = texts[0] if single else texts
    return {"text": text, "prompt": text}  # SGLang's key, then vLLM's
