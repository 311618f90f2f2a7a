"""OpenAI-compatible /v1/completions and /v1/chat/completions over the engine.

Requests map onto SamplingParams (max_tokens -> max_new_tokens, response_format's json_schema -> json_schema, and
json_object -> the schema {"type": "object"}, any object, as SGLang maps it; SGLang's
extras such as top_k, min_p and regex pass through). Prompts are templated and tokenized in a worker thread first,
so that the prompt and max_tokens are checked against the context before anything is queued. Answers follow the
shapes the official client parses: choices indexed prompt-major (n copies per prompt), finish_reason, logprobs, usage
with prompt_tokens_details.cached_tokens; streams send chunks with deltas, then an optional usage chunk
(stream_options.include_usage), then `data: [DONE]`.

Chat messages may hold `image_url` parts (base64 data URLs; the server fetches nothing): each becomes the model's
image token in the templated text, where the part was, and its image goes to the engine beside the prompt, as the
frontend's `sgl.image` does for a text backend.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from typing import AsyncIterator

from sgjax.engine.params import OPENAI_NAMES, SamplingParams, SamplingParamsError
from sgjax.engine.requests import check_token_ids
from sgjax.errors import RequestError
from sgjax.server import tools
from sgjax.server.chat_output import ChatOutput
from sgjax.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from sgjax.server.serving import HttpWork, Serving, bootstrap_rooms, params_error

OPENAI_RENAMES = {ours: theirs for ours, (theirs, _) in OPENAI_NAMES.items() if ours != theirs}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat uses SamplingParams' (128, as SGLang)


@dataclass(frozen=True)
class Prepared:
    """A validated OpenAI request: the engine's HttpWork plus what shaping the answer needs."""

    work: HttpWork
    n: int
    chat: bool
    echo_texts: tuple[str, ...] | None = None  # completions with echo: each prompt's text
    logprobs: int | None = None  # top logprobs per token; None: no logprobs
    include_usage: bool = False
    output: ChatOutput = ChatOutput()  # chat: how the answer's text becomes content, reasoning and tool calls


# -- requests ---------------------------------------------------------------------------------------------------
async def prepare_completion(serving: Serving, req: CompletionRequest) -> Prepared:
    need_tokenizer(serving)
    if req.suffix:
        raise ApiError("suffix: not supported", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise ApiError("best_of: only best_of == n is supported", param="best_of")
    ids, texts = await asyncio.to_thread(_completion_prompts, serving, req)
    top = _top_logprobs(serving, req.logprobs, "logprobs")
    echo = bool(req.echo)
    params = _sampling(
        serving, req, ids, "prompt", req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, req.json_schema, OPENAI_RENAMES
    )
    work = HttpWork(
        params=(params,) * len(ids),
        ids=tuple(ids),
        return_logprob=req.logprobs is not None,
        logprob_start_len=0 if echo and req.logprobs is not None else None,
        top_logprobs_num=top,
        prompt_field="prompt",
        renames=OPENAI_RENAMES,
        loras=None if req.lora_path is None else (req.lora_path,) * len(ids),
        bootstraps=bootstrap_rooms(req, True, len(ids)),
    )
    return Prepared(
        work=work,
        n=params.n,
        chat=False,
        echo_texts=tuple(texts) if echo else None,
        logprobs=req.logprobs,
        include_usage=_include_usage(req),
    )


async def prepare_chat(serving: Serving, req: ChatCompletionRequest) -> Prepared:
    need_tokenizer(serving)
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs: needs logprobs: true", param="top_logprobs")
    schema = _response_schema(req)
    tag = _structural_tag(req)
    reasoning = serving.reasoning
    if req.separate_reasoning is False or (req.chat_template_kwargs or {}).get("enable_thinking") is False:
        reasoning = None  # the reasoning stays in the content / the template told the model not to think
    # The calls' grammar admits a <think> block exactly when the answer's reasoning is split off from the content.
    plan = tools.plan(
        req, serving.tool_format, constrain=not serving.http.disable_tool_call_constraint, reasoning=reasoning
    )
    if plan.regex is not None and (
        schema is not None or tag is not None or req.regex is not None or req.ebnf is not None
    ):
        given = "regex" if req.regex is not None else "ebnf" if req.ebnf is not None else "response_format"
        raise ApiError(
            f"{given}: cannot be combined with tools under tool_choice {plan.choice!r}, whose calls have a "
            f"grammar of their own (tool_choice 'none' drops the tools)",
            param=given,
        )
    messages, images, fields = chat_messages(serving, req)
    messages, template_vars = tools.template_input(messages, plan, serving.tool_format, serving.tokenizer.chat_template)
    template_vars = {**_template_kwargs(req), **template_vars}
    ids = await asyncio.to_thread(_chat_prompt, serving, messages, template_vars)
    top = _top_logprobs(serving, req.top_logprobs, "top_logprobs")
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    renames = {
        **OPENAI_RENAMES,
        "max_new_tokens": max_field,
        "json_schema": "response_format.json_schema.schema",
        "structural_tag": "response_format",
    }
    if plan.regex is not None:
        renames["regex"] = "tools"  # the calls' grammar failed to compile (its size, the compile budget)
    expanded = len(images) * (serving.engine.images.cfg.num_image_tokens - 1) if images else 0
    params = _sampling(
        serving,
        req,
        [ids],
        "messages",
        asked,
        None,
        schema,
        renames,
        max_field,
        expanded,
        regex=plan.regex,
        structural_tag=tag,
    )
    work = HttpWork(
        params=(params,),
        ids=(ids,),
        return_logprob=bool(req.logprobs),
        top_logprobs_num=top,
        prompt_field="messages",
        renames=renames,
        images=(tuple(images),) if images else None,
        image_fields=(("messages", tuple(fields)),) if images else None,
        loras=None if req.lora_path is None else (req.lora_path,),
        bootstraps=bootstrap_rooms(req, True, 1),
    )
    output = ChatOutput(
        tools=serving.tool_format if plan.parse else None,
        reasoning=reasoning,
        stream_reasoning=req.stream_reasoning is not False,
    )
    return Prepared(
        work=work,
        n=params.n,
        chat=True,
        logprobs=top if req.logprobs else None,
        include_usage=_include_usage(req),
        output=output,
    )


_RESERVED_TEMPLATE_VARS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def _template_kwargs(req: ChatCompletionRequest) -> dict:
    kwargs = req.chat_template_kwargs or {}
    taken = sorted(set(kwargs) & _RESERVED_TEMPLATE_VARS)
    if taken:
        raise ApiError(
            f"chat_template_kwargs: {taken} are set by the server (messages, tools, ...)", param="chat_template_kwargs"
        )
    return kwargs


def need_tokenizer(serving: Serving) -> None:
    if serving.tokenizer is None:
        raise ApiError(
            "model: this server runs without a tokenizer (--skip-tokenizer-init); use /generate with input_ids",
            param="model",
        )


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _top_logprobs(serving: Serving, value: int | None, name: str) -> int:
    cap = serving.engine.args.max_top_logprobs_num
    if value is not None and value > cap:
        raise ApiError(f"{name}: at most {cap}, got {value}", param=name)
    return value or 0


def _completion_prompts(serving: Serving, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt (text, texts, ids or lists of ids) and its text (for echo)."""
    tok, p = serving.tokenizer, req.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise ApiError("prompt: the batch is empty", param="prompt")
    if isinstance(p[0], str):
        return [tok.encode(t) for t in p], list(p)
    batch = [p] if isinstance(p[0], int) else p
    for ids in batch:
        try:
            check_token_ids(ids, serving.engine.model_config.vocab_size, "prompt")
        except RequestError as e:
            raise params_error(e) from None
    return [list(ids) for ids in batch], [tok.decode(ids, skip_special_tokens=False) for ids in batch]


def chat_messages(serving: Serving, req: ChatCompletionRequest) -> tuple[list[dict], list[str], list[str]]:
    """The template's messages (text content, each image part replaced by the model's image token), the images in
    prompt order (base64) and the field each came from."""
    messages, images, fields = [], [], []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            pieces = []
            for j, part in enumerate(m.content):
                if part.type == "text":
                    pieces.append(part.text)
                    continue
                where = f"messages.{i}.content.{j}.image_url.url"
                if serving.image_token is None:
                    raise ApiError(
                        f"{where}: this server's model is text-only; images need a vision-language model "
                        f"(sgjax serve --model-path <a LLaVA checkpoint directory>)",
                        param=where,
                    )
                images.append(_data_url_payload(part.image_url.url, where))
                fields.append(where)
                pieces.append(serving.image_token)
            content = "".join(pieces)
        else:
            content = m.content or ""
        message = {"role": m.role, "content": content, **({"name": m.name} if m.name else {})}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(
                    f"messages.{i}.tool_calls: only assistant messages call tools", param=f"messages.{i}.tool_calls"
                )
            message["tool_calls"] = [(c.function.name, c.function.arguments) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages, images, fields


def _data_url_payload(url: str, where: str) -> str:
    if url.startswith(("http://", "https://")):
        raise ApiError(
            f"{where}: http(s) image URLs are not fetched (the server has no network access); send the "
            f"image inline as a data URL (data:image/png;base64,...)",
            param=where,
        )
    head, comma, payload = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise ApiError(
            f"{where}: expected a base64 data URL (data:image/png;base64,...), got {url[:40]!r}", param=where
        )
    return payload


def _chat_prompt(serving: Serving, messages: list[dict], template_vars: dict | None = None) -> list[int]:
    try:
        text = serving.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_vars or {}))
    except Exception as e:  # noqa: BLE001 - the template's own checks (role order, unknown roles) fail here
        raise ApiError(f"messages: the chat template refused them: {e}", param="messages") from None
    return serving.tokenizer.encode(text)


def _structural_tag(req: ChatCompletionRequest) -> dict | None:
    """response_format {"type": "structural_tag", "structures": [{begin, schema, end}], "triggers": [...]}."""
    rf = req.response_format
    if rf is None or rf.type != "structural_tag":
        return None
    if not rf.structures or not rf.triggers:
        raise ApiError("response_format: a structural_tag needs structures and triggers", param="response_format")
    return {
        "structures": [
            {"begin": s.begin, "schema": s.schema_ if s.schema_ is not None else {}, "end": s.end}
            for s in rf.structures
        ],
        "triggers": list(rf.triggers),
    }


def _response_schema(req: ChatCompletionRequest):
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "structural_tag":
        return None
    if rf.type == "json_object":  # as SGLang maps it: any object (containers nest at most FREE_DEPTH deep here)
        return {"type": "object"}
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ApiError(
            "response_format.json_schema.schema: required for type json_schema",
            param="response_format.json_schema.schema",
        )
    return rf.json_schema.schema_


def _sampling(
    serving: Serving,
    req,
    ids: list[list[int]],
    prompt_field: str,
    asked: int | None,
    default: int | None,
    json_schema,
    renames: dict,
    max_field: str = "max_tokens",
    expanded: int = 0,
    regex: str | None = None,
    structural_tag: dict | None = None,
) -> SamplingParams:
    """SamplingParams of an OpenAI request. Unlike /generate (which clips, as SGLang's native API does), a
    max_tokens that does not fit beside the prompt is an error, as in OpenAI's API. `expanded`: the rows the
    engine adds when it expands image tokens, which count against the limit too."""
    limit = serving.token_limit
    longest = max(len(x) for x in ids) + expanded
    for x in ids:
        if not x:
            raise ApiError(f"{prompt_field}: the prompt is empty (0 tokens)", param=prompt_field)
        if len(x) + expanded >= limit:
            raise ApiError(
                f"{prompt_field}: the prompt has {len(x) + expanded} tokens; at most {limit - 1} fit "
                f"({_limits(serving)})",
                param=prompt_field,
            )
    if asked is not None and longest + asked > limit:
        raise ApiError(
            f"{max_field}: {asked} new tokens plus the prompt's {longest} exceed the limit of {limit} "
            f"tokens ({_limits(serving)})",
            param=max_field,
        )
    d = {ours: getattr(req, theirs, None) for ours, (theirs, _) in OPENAI_NAMES.items()}
    d.update(max_new_tokens=asked if asked is not None else default, json_schema=json_schema)
    if regex is not None:
        d["regex"] = regex
    if structural_tag is not None:
        d["structural_tag"] = structural_tag
    try:
        return SamplingParams.from_dict({k: v for k, v in d.items() if v is not None})
    except SamplingParamsError as e:
        raise params_error(e, "", renames) from None


def _limits(serving: Serving) -> str:
    return f"context_length {serving.engine.context_length}, max_total_tokens {serving.engine.max_total_tokens}"


# -- answers ----------------------------------------------------------------------------------------------------
def response(serving: Serving, prep: Prepared, results: list[dict]) -> dict:
    choices = []
    for k, r in enumerate(results):
        meta = r["meta_info"]
        called = False
        if prep.chat:
            message, called = prep.output.message(r["text"])
            choice = {"index": k, "message": message, "logprobs": _chat_logprobs(serving, prep, meta, 0)}
        else:
            echo = prep.echo_texts[k // prep.n] if prep.echo_texts else ""
            choice = {
                "index": k,
                "text": echo + r["text"],
                "logprobs": _completion_logprobs(serving, prep, meta, 0, True, 0),
            }
        choices.append({**choice, **_finish(meta, called)})
    return {**_head(serving, prep, uuid.uuid4().hex), "choices": choices, "usage": _usage(results, prep.n)}


async def events(serving: Serving, prep: Prepared, merged: AsyncIterator) -> AsyncIterator[dict]:
    """Stream chunks: text deltas of each choice as its engine stream grows (the engine's text is cumulative)."""
    head = _head(serving, prep, uuid.uuid4().hex, chunk=True)
    seen: dict[int, tuple[int, int, int]] = {}  # index -> (text chars, output logprobs, text offset) sent
    finals: dict[int, dict] = {}
    parsed = {}  # index -> its ChatStream, when the answer's text is parsed (reasoning, tool calls)
    async for k, item in merged:
        meta, text = item["meta_info"], item["text"]
        first = k not in seen
        sent_text, sent_lp, offset = seen.get(k, (0, 0, 0))
        delta = text[sent_text:]
        if prep.chat:
            if first:
                yield {
                    **head,
                    "choices": [
                        {
                            "index": k,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            lp = _chat_logprobs(serving, prep, meta, sent_lp)
        else:
            if first and prep.echo_texts:
                delta = prep.echo_texts[k // prep.n] + delta
            lp = _completion_logprobs(serving, prep, meta, sent_lp, first, offset)
        seen[k] = (
            len(text),
            len(meta.get("output_token_logprobs", ())),
            offset + sum(len(t) for t in lp["tokens"]) if lp and not prep.chat else offset,
        )
        finished = meta["finish_reason"] is not None
        if not (delta or finished or _has_tokens(lp)):
            continue
        if prep.chat and not prep.output.plain:
            stream = parsed.setdefault(k, prep.output.stream())
            pieces = stream.feed(text, finished)
            if not pieces and _has_tokens(lp):
                pieces = [{}]  # text held back (a possible tag), its tokens' logprobs sent now
            # One chunk per piece, as OpenAI sends them; the logprobs ride on the first.
            for piece in pieces:
                yield {**head, "choices": [{"index": k, "delta": piece, "logprobs": lp, "finish_reason": None}]}
                lp = None
            if finished:
                yield {**head, "choices": [{"index": k, "delta": {}, "logprobs": lp, **_finish(meta, stream.called)}]}
                finals[k] = item
            continue
        if prep.chat:
            choice = {"index": k, "delta": {"content": delta} if delta else {}, "logprobs": lp}
        else:
            choice = {"index": k, "text": delta, "logprobs": lp}
        reason = _finish(meta) if finished else {"finish_reason": None}
        yield {**head, "choices": [{**choice, **reason}]}
        if finished:
            finals[k] = item
    if prep.include_usage:
        yield {**head, "choices": [], "usage": _usage([finals[k] for k in sorted(finals)], prep.n)}


def _head(serving: Serving, prep: Prepared, rid: str, chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if prep.chat else "text_completion"
    return {
        "id": ("chatcmpl-" if prep.chat else "cmpl-") + rid,
        "object": kind,
        "created": int(time.time()),
        "model": serving.model_name,
    }


def _finish(meta: dict, called: bool = False) -> dict:
    reason = meta["finish_reason"] or {}
    kind = reason.get("type")
    if called and kind == "stop":  # OpenAI's reason for an answer that calls tools (a cut-off one stays "length")
        kind = "tool_calls"
    return {"finish_reason": kind, "matched_stop": reason.get("matched")}


def _usage(results: list[dict], n: int) -> dict:
    """Each prompt's tokens count once, however many copies (n) were generated from it."""
    metas = [r["meta_info"] for r in results]
    groups = [metas[i : i + n] for i in range(0, len(metas), n)]
    prompt = sum(g[0]["prompt_tokens"] for g in groups)
    completion = sum(m["completion_tokens"] for m in metas)
    cached = sum(max(m["cached_tokens"] for m in g) for g in groups)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _has_tokens(lp) -> bool:
    return bool(lp and (lp.get("tokens") or lp.get("content")))


def _completion_logprobs(serving: Serving, prep: Prepared, meta: dict, start: int, with_prompt: bool, offset: int):
    """The completions shape (tokens, token_logprobs, top_logprobs, text_offset) of output tokens from `start`,
    preceded by the prompt's when echoing."""
    if prep.logprobs is None:
        return None
    entries = list(meta["output_token_logprobs"][start:])
    tops = list(meta.get("output_top_logprobs", [None] * len(meta["output_token_logprobs"]))[start:])
    if with_prompt and prep.echo_texts:
        entries = list(meta["input_token_logprobs"]) + entries
        tops = list(meta.get("input_top_logprobs", [None] * len(meta["input_token_logprobs"]))) + tops
    tokens = [serving.token_piece(t)[0] for _, t, _ in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [None if row is None else {serving.token_piece(t)[0]: lp for lp, t, _ in row} for row in tops]
        if prep.logprobs
        else None,
        "text_offset": [offset + x for x in accumulate([0] + [len(t) for t in tokens[:-1]])] if tokens else [],
    }


def _chat_logprobs(serving: Serving, prep: Prepared, meta: dict, start: int):
    if prep.logprobs is None:
        return None
    entries = meta["output_token_logprobs"][start:]
    tops = meta.get("output_top_logprobs", [None] * len(meta["output_token_logprobs"]))[start:]

    def one(lp, t):
        text, raw = serving.token_piece(t)
        return {"token": text, "logprob": lp, "bytes": list(raw)}

    return {
        "content": [
            {**one(lp, t), "top_logprobs": [one(l2, t2) for l2, t2, _ in row or ()]}
            for (lp, t, _), row in zip(entries, tops)
        ],
        "refusal": None,
    }
