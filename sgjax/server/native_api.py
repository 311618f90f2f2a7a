"""SGLang's native /generate: the Engine's arguments and result dicts over HTTP.

A body holds `text` or `input_ids` (one prompt or a batch), `sampling_params` (one dict or one per prompt), `rid`,
`return_logprob`, `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs` and `stream`. The answer is the
Engine's result dict (a list for a batch or n > 1); a stream sends `data: {result so far, "index"}` events whose
`text` grows, then `data: [DONE]`.
"""

from __future__ import annotations

from typing import AsyncIterator

from sgjax.engine.params import SamplingParams, SamplingParamsError
from sgjax.server.protocol import ApiError, GenerateRequest
from sgjax.server.serving import Serving, Work, params_error

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")
_TOP_KEYS = ("input_top_logprobs", "output_top_logprobs")


def generate_work(req: GenerateRequest) -> tuple[Work, bool]:
    """The Work of a /generate body, and whether the answer is one dict (one prompt, n == 1) or a list."""
    if req.image_data is not None:
        raise ApiError("image_data: sgjax serve takes no images yet (the in-process Engine does, for LLaVA "
                       "checkpoints)", param="image_data")
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
        raise ApiError(f"sampling_params: {len(prompts)} prompts but {len(raw)} sampling_params",
                       param="sampling_params")
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
            raise ApiError(f"rid: give one rid per prompt ({len(prompts)}), a string for a single prompt",
                           param="rid")
    work = Work(params=tuple(params), texts=tuple(prompts) if field == "text" else None,
                ids=tuple(prompts) if field == "input_ids" else None, rids=tuple(rids) if rids else None,
                return_logprob=bool(req.return_logprob), logprob_start_len=req.logprob_start_len,
                top_logprobs_num=req.top_logprobs_num, prompt_field=field, params_field="sampling_params")
    return work, single and params[0].n == 1


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
