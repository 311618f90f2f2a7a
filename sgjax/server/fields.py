"""The request policy, as one table: what the server does with a field of SGLang's or OpenAI's API beside the ones
it implements (docs/server.md, "Request policy").

- A field sgjax implements is a field of the route's pydantic model (server/protocol.py): validated strictly, a 400
  naming it when wrong.
- `Unsupported`: a field the APIs define that sgjax does not implement. Accepted at its null / empty / default value
  (clients send those routinely: SGLang's frontend sends `"stop_regex": []`),
  and a 400 naming the field when a client really asks for it.
- `Meta`: bookkeeping that changes nothing in the output (`user`, `store`, `metadata`, ...): accepted whatever its
  value. (`rid` and `priority` are fields of the models where they are used.)
- Anything else is ignored, as upstream's request models ignore unknown keys; each unknown key is logged once, at
  debug level.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sgjax.server.protocol import ApiError

log = logging.getLogger("sgjax.server")


@dataclass(frozen=True)
class Unsupported:
    what: str  # why a real value is refused, in the 400's message
    defaults: tuple = ()  # values besides null (and empty containers) that mean "not asked for"


@dataclass(frozen=True)
class Meta:
    what: str


_NO = Unsupported("not supported by sgjax")
_FALSE = Unsupported("not supported by sgjax", (False,))
_MM = Unsupported("this modality is not supported by sgjax")
_PD = Unsupported("not supported by sgjax's prefill/decode disaggregation")
_ROUTE = Meta("routing hint for multi-worker deployments; sgjax serve has one engine")
# A data-parallel rank: SGLang's `routed_dp_rank` and its older name `data_parallel_rank`, which sglang-router
# --dp-aware sets. One engine is rank 0 of dp_size 1 (/server_info), so that router sends it 0; the router of
# `sgjax serve --dp-size N` reports dp_size N and sends rank r to its worker r without the field (router/keys.py).
_RANK = Unsupported("out of range [0, 1): one engine (dp_size 1); `sgjax serve --dp-size N` routes ranks 0..N-1", (0,))

# SGLang's /generate (GenerateReqInput), beyond what native_api implements.
GENERATE = {
    "lora_id": Unsupported("adapters are named by lora_path"),
    "return_hidden_states": _FALSE,
    "return_routed_experts": _FALSE,
    "return_indexer_topk": _FALSE,
    "routed_experts_start_len": Unsupported("not supported by sgjax", (0,)),
    "custom_logit_processor": _NO,
    "session_params": _NO,
    "session_id": _NO,
    "input_embeds": _NO,
    "video_data": _MM,
    "audio_data": _MM,
    "use_audio_in_video": _FALSE,
    "video_config": _MM,
    "mm_hashes": _NO,
    "mm_content_hashes": _NO,
    "modalities": Unsupported("sgjax generates text only", (["text"],)),
    "token_ids_logprob": _NO,
    "return_sampling_mask": _FALSE,
    "sampling_logprobs_mode": _NO,
    "return_flat_raw_top_logprobs": _FALSE,
    "return_flat_raw_output_top_logprobs": _FALSE,
    "watermark": _NO,
    "positional_embed_overrides": _NO,
    "background": _FALSE,
    "require_reasoning": _FALSE,
    "max_thinking_tokens": _NO,
    "bootstrap_pair_key": _PD,
    "decode_tp_size": _PD,
    "disagg_prefill_dp_rank": _PD,
    "data_parallel_rank": _RANK,
    "routed_dp_rank": _RANK,
    "routing_key": _ROUTE,
    "conversation_id": _ROUTE,
    "log_metrics": Meta("sgjax's metrics count every request"),
    "no_logs": Meta("request logging is --log-requests"),
    "custom_labels": Meta("metric labels"),
    "http_worker_ipc": Meta("SGLang-internal"),
}

# SGLang's sampling parameters (SamplingParams) beyond what engine/params.py implements.
SAMPLING = {
    "custom_params": _NO,
    "watermark": _NO,
    "beam_width": Unsupported("beam search is not supported by sgjax", (1,)),
    "stream_interval": Meta("sgjax streams every token"),
}

# OpenAI's and SGLang's fields of /v1/completions and /v1/chat/completions beyond protocol.py's.
_OPENAI_COMMON = {
    "store": Meta("sgjax keeps no completions"),
    "metadata": Meta("stored completions' tags"),
    "service_tier": Meta("one tier"),
    "prompt_cache_key": Meta("sgjax's radix cache needs no key"),
    "safety_identifier": Meta("end-user id"),
    "custom_labels": Meta("metric labels"),
    "session_id": _NO,
    "session_params": _NO,
    "custom_logit_processor": _NO,
    "custom_params": _NO,
    "watermark": _NO,
    "return_hidden_states": _FALSE,
    "return_routed_experts": _FALSE,
    "routed_experts_start_len": GENERATE["routed_experts_start_len"],
    "return_cached_tokens_details": _FALSE,
    "return_spec_tokens_details": _FALSE,
    "return_token_ids": _FALSE,
    "images_config": _MM,
    "mm_processor_kwargs": _MM,
    "data_parallel_rank": _RANK,
    "routed_dp_rank": _RANK,
    "routing_key": _ROUTE,
    "conversation_id": _ROUTE,
    "bootstrap_pair_key": _PD,
    "extra_key": Meta("cache namespaces are set by sgjax (images)"),
    "cache_salt": Meta("one tenant per server"),
}
COMPLETIONS = {**_OPENAI_COMMON}
CHAT = {
    **_OPENAI_COMMON,
    "reasoning_effort": Unsupported("reasoning effort is not supported by sgjax"),
    "thinking": _NO,
    "verbosity": _NO,
    "prediction": Unsupported("predicted outputs are not supported by sgjax"),
    "audio": _MM,
    "modalities": GENERATE["modalities"],
    "web_search_options": _NO,
    "functions": Unsupported("the deprecated functions are not supported by sgjax; use tools"),
    "function_call": Unsupported("the deprecated function_call is not supported by sgjax; use tool_choice", ("none",)),
    "continue_final_message": _FALSE,
    "return_prompt_token_ids": _FALSE,
    "return_meta_info": _FALSE,
    "return_input_ids_in_sglext": _FALSE,
    "return_output_ids_in_sglext": _FALSE,
    "return_sampling_mask": _FALSE,
    "sampling_logprobs_mode": _NO,
    "return_flat_raw_output_top_logprobs": _FALSE,
    "max_dynamic_patch": _MM,
    "min_dynamic_patch": _MM,
    "use_audio_in_video": _FALSE,
    "video_config": _MM,
    "input_ids": _NO,
    "task": _NO,
}

_seen_unknown: set[tuple[str, str]] = set()


def _unset(value, defaults: tuple) -> bool:
    """Null, empty, one of the defaults, or a list of such (a batch's per-prompt values)."""
    if value is None or value in ((), [], {}, "") or any(value == d and type(value) is type(d) for d in defaults):
        return True
    return isinstance(value, list) and all(_unset(v, defaults) for v in value)


def screen(body: dict, known, table: dict, route: str, prefix: str = "", keep_unknown: bool = False) -> dict:
    """`body` without the table's fields (refusing real values of unsupported ones) and without unknown keys, for
    the route's strict model. `known`: the model's own field names. `keep_unknown`: leave unknown keys for the model
    to refuse (SGLang's sampling parameters: upstream refuses unknown ones too)."""
    out = {}
    for key, value in body.items():
        if key in known:
            out[key] = value
            continue
        policy = table.get(key)
        if isinstance(policy, Unsupported):
            if not _unset(value, policy.defaults):
                name = f"{prefix}{key}"
                raise ApiError(f"{name}: {policy.what}", param=name, code="unsupported_parameter")
        elif policy is None:
            if keep_unknown:
                out[key] = value
            elif (route, key) not in _seen_unknown:
                _seen_unknown.add((route, key))
                log.debug("%s: ignored unknown field %r", route, f"{prefix}{key}")
    return out


# SGLang's /v1/score beyond the pointwise causal-LM scoring sgjax implements.
SCORE = {
    "embed_override_token_id": _NO,
    "query_embed_overrides": _NO,
    "item_embed_overrides": _NO,
    "return_pooled_hidden_states": Unsupported("pooled hidden states are for classification models", (False,)),
    "score_extraction_token": Unsupported("setwise scoring is not supported by sgjax"),
}
# SGLang's /update_weights_from_disk beyond a checkpoint swapped in place.
UPDATE_WEIGHTS = {
    "load_format": Unsupported("the loader reads the checkpoint's own format", ("auto",)),
    "is_async": _FALSE,
    "keep_pause": _FALSE,
    "torch_empty_cache": Meta("a torch allocator setting; sgjax has none"),
    "recapture_cuda_graph": Meta("sgjax captures no CUDA graphs"),
    "token_step": Meta("a trainer's step counter; not read"),
}
# A chat message's fields beyond ChatMessage's.
MESSAGE = {
    "refusal": Meta("the assistant's refusal text; not read"),
    "reasoning_content": Meta("an earlier answer's reasoning; the chat template gets the content"),
    "audio": _MM,
    "function_call": CHAT["function_call"],
}


def _sampling_known() -> set[str]:
    from dataclasses import fields

    from sgjax.engine.params import _ALIASES, SamplingParams

    return {f.name for f in fields(SamplingParams)} | set(_ALIASES)


def screener(route: str):
    """The screen of one route's body: its table, and the nested dicts that have tables of their own."""
    from sgjax.server import protocol as P

    def generate(body: dict) -> dict:
        out = screen(body, P.GenerateRequest.model_fields, GENERATE, route)
        sp = out.get("sampling_params")
        known = _sampling_known()
        if isinstance(sp, dict):
            out["sampling_params"] = screen(sp, known, SAMPLING, route, "sampling_params.", keep_unknown=True)
        elif isinstance(sp, list):
            out["sampling_params"] = [
                screen(d, known, SAMPLING, route, f"sampling_params.{i}.", keep_unknown=True)
                if isinstance(d, dict)
                else d
                for i, d in enumerate(sp)
            ]
        return out

    def chat(body: dict) -> dict:
        out = screen(body, P.ChatCompletionRequest.model_fields, CHAT, route)
        if isinstance(out.get("messages"), list):
            out["messages"] = [
                screen(m, P.ChatMessage.model_fields, MESSAGE, route, f"messages.{i}.") if isinstance(m, dict) else m
                for i, m in enumerate(out["messages"])
            ]
        return out

    def completions(body: dict) -> dict:
        return screen(body, P.CompletionRequest.model_fields, COMPLETIONS, route)

    def plain(model):
        return lambda body: screen(body, model.model_fields, {}, route)

    table = {
        "/generate": generate,
        "/v1/chat/completions": chat,
        "/v1/completions": completions,
        "/v1/embeddings": plain(P.EmbeddingRequest),
        "/tokenize": plain(P.TokenizeRequest),
        "/detokenize": plain(P.DetokenizeRequest),
        "/abort_request": plain(P.AbortRequest),
        "/update_weights_from_disk": lambda body: screen(
            body, P.UpdateWeightsFromDiskRequest.model_fields, UPDATE_WEIGHTS, route
        ),
        "/pause_generation": plain(P.PauseGenerationRequest),
        "/release_memory_occupation": plain(P.MemoryOccupationRequest),
        "/resume_memory_occupation": plain(P.MemoryOccupationRequest),
        "/load_lora_adapter": plain(P.LoadLoraAdapterRequest),
        "/unload_lora_adapter": plain(P.UnloadLoraAdapterRequest),
        "/v1/score": lambda body: screen(body, P.ScoreRequest.model_fields, SCORE, route),
    }
    return table[route]
