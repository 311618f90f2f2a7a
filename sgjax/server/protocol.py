"""Request bodies: raw bytes -> UTF-8 -> JSON -> a strict pydantic model, every failure an `ApiError` naming the field.

Models are strict (no "5" -> 5, no 1 -> True), reject unknown keys and non-finite numbers, so handlers only see
well-typed values. Value ranges that depend on the model (vocabulary, context, top-logprob cap) and the sampling
parameters' own rules are checked later by `SamplingParams` and the engine, whose messages also name the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

MAX_BODY_BYTES = 32 << 20
_MAX_DEPTH = 64  # JSON nesting; deeper bodies are refused before anything recurses over them
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")


class ApiError(Exception):
    """A request the server refuses; `message` starts with the offending field's name."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.code = message, status, param, kind, code
        self.headers = headers

    def body(self) -> dict:
        # OpenAI's error shape: the official client reads error.message; SGLang's clients read the same key. `code`
        # is a string or null, as OpenAI's (the status is the response's own).
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused with a 413 as soon as it passes `limit` (by its Content-Length, or while it
    streams in): a 1 GB body is not read whole before the check."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"body: larger than {limit} bytes", status=413, param="body")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"body: larger than {limit} bytes", status=413, param="body")
        parts.append(chunk)
    return b"".join(parts)


def parse_body(raw: bytes, model: type[BaseModel], screen=None) -> Any:
    """raw -> the route's model. `screen` (server/fields.py) first drops the request policy's fields from the decoded
    body, refusing real values of unsupported ones."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(f"body: larger than {MAX_BODY_BYTES} bytes", status=413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(f"body: invalid UTF-8 at byte {e.start}", param="body") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as e:
        raise ApiError(f"body: malformed JSON: {e.msg} at line {e.lineno} column {e.colno}", param="body") from None
    except (ValueError, RecursionError) as e:
        raise ApiError(f"body: {e}", param="body") from None
    if not isinstance(obj, dict):
        raise ApiError(f"body: must be a JSON object, got {type(obj).__name__}", param="body")
    _check_strings(obj, "", 0)
    if screen is not None:
        obj = screen(obj)
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        raise _validation_error(e) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf
        raise ValueError(f"the number {text} is out of range")
    return value


def _check_strings(value, path: str, depth: int) -> None:
    """JSON may spell lone surrogates (\\ud800) that no tokenizer can encode; refuse them here, naming the field."""
    if depth > _MAX_DEPTH:
        raise ApiError(f"{path or 'body'}: nested deeper than {_MAX_DEPTH} levels", param=path or "body")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(f"{path or 'body'}: invalid Unicode (a lone surrogate)", param=path or "body") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path or "body", depth + 1)
            _check_strings(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}.{i}" if path else str(i), depth + 1)


def _validation_error(e: ValidationError) -> ApiError:
    # A value that fits no member of a union fails once per member; the deepest failure is the one that says what
    # is wrong inside it (an image part's missing url, not "Input should be a valid string" for the whole list).
    err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
    # Union members and validators add their type names to the location; keep only field names and indices.
    path = (
        ".".join(str(p) for p in err["loc"] if isinstance(p, int) or (_FIELD.match(p) and p not in _TYPE_TAGS))
        or "body"
    )
    if err["type"] == "extra_forbidden":
        return ApiError(f"{path}: unknown parameter", param=path)
    if err["type"] == "missing":
        return ApiError(f"{path}: required", param=path)
    got = repr(err.get("input"))
    return ApiError(f"{path}: {err['msg']}, got {got[:80]}", param=path)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# -- SGLang's /generate ----------------------------------------------------------------------------------------
class GenerateRequest(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    # SGLang's images beside the text (base64): one prompt takes a string or a list of strings; a batch takes one
    # entry per prompt (a string, a list of strings, or null for a prompt without images)
    image_data: str | list[str | list[str] | None] | None = None
    # a loaded LoRA adapter's name (--enable-lora): one for every prompt, or a list with one per prompt (null: base)
    lora_path: str | list[str | None] | None = None
    # prefill/decode disaggregation (sglang-router --pd-disaggregation sets them): the prefill worker's host and
    # bootstrap port and the room both workers know the request by; lists for a batch, one per prompt
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None


class AbortRequest(Strict):
    rid: str | None = None
    abort_all: bool | None = None


# -- serving a training loop (engine/training.py) ---------------------------------------------------------------
class UpdateWeightsFromDiskRequest(Strict):
    model_path: str
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class LoadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # SGLang's: kept in a slot; accepted (sgjax's slots go least recently used first)


class UnloadLoraAdapterRequest(Strict):
    lora_name: str = Field(min_length=1)


class PauseGenerationRequest(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(Strict):
    tags: list[Literal["kv_cache"]] | None = None  # SGLang's "weights" / "cuda_graph": the KV cache only here


# -- OpenAI ----------------------------------------------------------------------------------------------------
class StreamOptions(Strict):
    include_usage: bool | None = None


class SglangExtras(Strict):
    """SGLang's sampling extensions to the OpenAI requests (the openai client sends them via extra_body)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    rid: str | None = None  # SGLang's: the request id (/abort_request reaches it)
    lora_path: str | None = None  # a loaded LoRA adapter's name (--enable-lora); null: the base model
    bootstrap_host: str | None = None  # prefill/decode disaggregation (set by sglang-router): see GenerateRequest
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class OpenAIBase(SglangExtras):
    model: str | None = None  # one model per server: any name is accepted, responses carry the served name
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    json_schema: str | dict[str, Any] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageUrl(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted for OpenAI clients; LLaVA has one resolution


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


def _part_kind(part):
    kinds = {"text": "TextPart", "image_url": "ImagePart"}  # capitalised tags stay out of the error paths
    return kinds.get(part.get("type")) if isinstance(part, dict) else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")],
    Discriminator(
        _part_kind,
        custom_error_type="content_part",
        custom_error_message="a content part needs type 'text' or 'image_url'",
    ),
]


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(Strict):
    """An earlier assistant turn's call, as the client sends it back in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # streamed calls carry their index; clients that rebuild messages from them keep it


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TagStructure(Strict):
    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = None  # structural_tag (SGLang's): the constrained islands
    triggers: list[str] | None = None


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: calls are always constrained to the schema when the grammar applies


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's reasoning switches (with --reasoning-parser): separate_reasoning false leaves the reasoning in the
    # content; stream_reasoning false sends it whole when it ends; chat_template_kwargs are the template's variables
    # (Qwen3's enable_thinking)
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- tokenizer and embeddings -------------------------------------------------------------------------------
class TokenizeRequest(Strict):
    """SGLang's and vLLM's /tokenize: `text` (SGLang) or `prompt` (vLLM), or chat `messages` (vLLM)."""

    model: str | None = None
    text: str | list[str] | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] | list[list[int]]


class ScoreRequest(Strict):
    """SGLang's /v1/score (pointwise, causal LM): the probability of each label token as the next token after
    query + item (item + query with item_first)."""

    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | list[list[int]] | None = None
    apply_softmax: bool = False
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    item_first: bool = False
    return_token_logprobs: bool = False


class EmbeddingRequest(Strict):
    """OpenAI's /v1/embeddings: `input` as a text, texts, ids or lists of ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
