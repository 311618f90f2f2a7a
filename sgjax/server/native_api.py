"""SGLang's native /generate: the Engine's arguments and result dicts over HTTP.

A body holds `text` or `input_ids` (one prompt or a batch), `sampling_params` (one dict or one per prompt), `rid`,
`return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`, `stream` and `image_data`
(base64 images, one image token each in the prompt: a string or a list of strings for one prompt, one such entry or
null per prompt for a batch). The answer is the
Engine's result dict (a list for a batch or n > 1); a stream sends `data: {result so far, "index"}` events whose
`text` grows, then `data: [DONE]`.
"""

from __future__ import annotations

from typing import AsyncIterator

from sgjax.engine.params import SamplingParams, SamplingParamsError
from sgjax.server.protocol import ApiError, GenerateRequest
from sgjax.server.serving import HttpWork, Serving, bootstrap_rooms, params_error

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


def generate_work(req: GenerateRequest) -> tuple[HttpWork, bool]:
    """The HttpWork of a /generate body, and whether the answer is one dict (one prompt, n == 1) or a list."""
    if (req.text is None) == (req.input_ids is None):
        raise ApiError("text: give exactly one of text or input_ids", param="text")
    field = "text" if req.text is not None else "input_ids"
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts = [req.text] if single else list(req.text)
    else:
        single = not (req.input_ids and isinstance(req.input_ids[0], list))
        prompts = [req.input_ids] if single else list(req.input_ids)
    if not prompts:
        raise ApiError(f"{field}: the batch is empty", param=field)
    raw = req.sampling_params
    if isinstance(raw, list) and len(raw) != len(prompts):
        raise ApiError(
            f"sampling_params: {len(prompts)} prompts but {len(raw)} sampling_params", param="sampling_params"
        )
    params = []
    for i in range(len(prompts)):
        where = f"sampling_params.{i}" if isinstance(raw, list) else "sampling_params"
        try:
            params.append(SamplingParams.from_dict(raw[i] if isinstance(raw, list) else raw))
        except SamplingParamsError as e:
            raise params_error(e, where) from None
    rids = req.rid
    if rids is not None:
        rids = [rids] if isinstance(rids, str) else list(rids)
        if isinstance(req.rid, str) != single or len(rids) != len(prompts):
            raise ApiError(f"rid: give one rid per prompt ({len(prompts)}), a string for a single prompt", param="rid")
    images, image_fields = (None, None) if req.image_data is None else _images(req.image_data, single, len(prompts))
    loras = req.lora_path
    if isinstance(loras, list) and (single or len(loras) != len(prompts)):
        raise ApiError(
            f"lora_path: a list takes one adapter name per prompt ({len(prompts)}); a string names one for all",
            param="lora_path",
        )
    if loras is not None:
        loras = tuple(loras) if isinstance(loras, list) else (loras,) * len(prompts)
    bootstraps = bootstrap_rooms(req, single, len(prompts))
    work = HttpWork(
        params=tuple(params),
        texts=tuple(prompts) if field == "text" else None,
        ids=tuple(prompts) if field == "input_ids" else None,
        rids=tuple(rids) if rids else None,
        return_logprob=bool(req.return_logprob),
        logprob_start_len=req.logprob_start_len,
        top_logprobs_num=req.top_logprobs_num,
        prompt_field=field,
        params_field="sampling_params",
        images=images,
        image_fields=image_fields,
        loras=loras,
        bootstraps=bootstraps,
    )
    return work, single and params[0].n == 1


def _images(data, single: bool, count: int):
    """SGLang's image_data shapes -> each prompt's images (or None) and the fields they came from."""
    if single:
        if isinstance(data, str):
            return ((data,),), (("image_data", ("image_data",)),)
        if not all(isinstance(d, str) for d in data):
            raise ApiError(
                "image_data: one prompt takes a string or a list of strings (a list per prompt is for a "
                "batch of prompts)",
                param="image_data",
            )
        return (tuple(data),), (("image_data", tuple(f"image_data.{k}" for k in range(len(data)))),)
    if isinstance(data, str) or len(data) != count:
        got = "a string" if isinstance(data, str) else f"{len(data)} entries"
        raise ApiError(
            f"image_data: a batch of {count} prompts takes a list of {count} entries (a string, a list of "
            f"strings or null for each prompt), got {got}",
            param="image_data",
        )
    images, fields = [], []
    for i, d in enumerate(data):
        where = f"image_data.{i}"
        if d is None or isinstance(d, str):
            images.append(None if d is None else (d,))
            fields.append((where, (where,)))
        else:
            images.append(tuple(d))
            fields.append((where, tuple(f"{where}.{k}" for k in range(len(d)))))
    return tuple(images), tuple(fields)


def with_token_text(result: dict, serving: Serving) -> dict:
    """return_text_in_logprobs: fill the third element of each (logprob, token_id, text) entry."""
    meta = dict(result["meta_info"])
    name = lambda t: serving.token_piece(t)[0]  # noqa: E731
    for key in _LOGPROB_KEYS:
        if key in meta:
            meta[key] = [(lp, t, name(t)) for lp, t, _ in meta[key]]
    for key in _TOP_KEYS:
        if key in meta:
            meta[key] = [None if row is None else [(lp, t, name(t)) for lp, t, _ in row] for row in meta[key]]
    return {**result, "meta_info": meta}


async def generate_events(serving: Serving, merged: AsyncIterator, texts_in_logprobs: bool):
    async for index, item in merged:
        yield {**(with_token_text(item, serving) if texts_in_logprobs else item), "index": index}
