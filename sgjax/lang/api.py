"""The public API of the language, with SGLang's names and signatures (`import sgjax as sgl`)."""

from __future__ import annotations

from typing import Callable

from sgjax.engine.params import OPENAI_NAMES
from sgjax.lang.backend.default import as_backend, get_default_backend, resolve_backend, set_default_backend  # noqa: F401
from sgjax.lang.choices import ChoicesMethod, token_length_normalized
from sgjax.lang.function import Function
from sgjax.lang.ir import ExprList, Image, RoleBegin, RoleEnd, Select, SeparateReasoning, make_gen, role
from sgjax.lang.media import encode_image, sample_frames


# -- backends -----------------------------------------------------------------------------------------------
def flush_cache(backend=None) -> bool:
    return resolve_backend(backend).flush_cache()


def get_server_info(backend=None) -> dict:
    return resolve_backend(backend).get_server_info()


# -- programs -----------------------------------------------------------------------------------------------
def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None):
    """`@sgl.function` turns `def program(s, ...)` into a Function you can run, batch and trace.
    `num_api_spec_tokens=N`: API speculative execution, a gen's call continues N tokens past its stop and later
    gens are matched in that text (sgjax/lang/speculative.py)."""
    if func is not None:
        return Function(func, num_api_spec_tokens=num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)


# -- expressions --------------------------------------------------------------------------------------------
_SGLANG_NAME = {theirs: ours for ours, (theirs, _) in OPENAI_NAMES.items() if theirs != ours}


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop=None,
    stop_token_ids=None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    dtype=None,
    choices=None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema=None,
    *,
    return_text_in_logprobs: bool | None = None,
    n: int | None = None,
    stop_regex=None,
):
    """Generate text into variable `name` (`s[name]`) and append it to the prompt. With `choices`, a select.
    `return_logprob` / `top_logprobs_num` / `return_text_in_logprobs` put the runtime's logprobs
    (`input_token_logprobs`, `output_token_logprobs`, `*_top_logprobs`: [logprob, token_id, text] entries) in the
    variable's meta info (`s.get_meta_info(name)`). `stop_regex`: Python regexes that stop the gen once the output
    matches one (SGLang's; the text keeps the match). SGLang's `n` exists for its signature: n > 1 is refused (one
    value per gen)."""
    if n is not None and n != 1:
        raise ValueError(f"gen: n={n!r} is not supported (a gen has one value); fork the state n times instead")
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    # gen's sampling arguments carry the OpenAI API's names (max_tokens, min_tokens): SGLang's names from the table
    sampling = dict(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex or None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
    )
    return make_gen(
        name,
        dtype=dtype,
        regex=regex,
        json_schema=json_schema,
        **{_SGLANG_NAME.get(k, k): v for k, v in sampling.items()},
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )


def gen_int(name: str | None = None, **kwargs):
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs):
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices=None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
):
    """Append the most likely of `choices` (scored with prompt logprobs) and store it in `s[name]`."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select needs a non-empty list of non-empty strings, got {choices!r}")
    if temperature:
        raise ValueError("select picks the best-scoring choice; temperature > 0 is not supported")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(
            f"choices_method must be one of sgl.token_length_normalized, sgl.greedy_token_selection, "
            f"sgl.unconditional_likelihood_normalized (or a ChoicesSamplingMethod); got {choices_method!r}"
        )
    return Select(name, tuple(choices), choices_method)


def separate_reasoning(expr=None, model_type: str | None = None) -> ExprList:
    """`expr` (a named gen or select, or a list of them), then split each value's reasoning (`<think>...</think>`)
    from its answer: `s[name]` is the answer (also in the text, in place of the whole value) and
    `s[name + "_reasoning_content"]` the reasoning. `model_type` is SGLang's reasoning-parser name ("deepseek-r1":
    everything before </think> is reasoning; "qwen3": only a <think> block is); None: only a <think> block, so on a
    model that never writes one the reasoning is empty (sgjax/lang/reasoning.py)."""
    if expr is None:
        raise ValueError("separate_reasoning needs an expression (a named gen or select)")
    return ExprList.of(expr, SeparateReasoning(model_type, expr))


def image(image) -> Image:
    """An image in the prompt: a file path, http(s) URL, bytes, data URI, PIL image or uint8 array [H, W, 3].
    The text gets the chat template's image token; the image travels to the backend beside the text (SGLang's
    image_data) or, for a chat API, as an image part of the message."""
    return Image((encode_image(image),))


def video(video, num_frames: int) -> Image:
    """`num_frames` evenly spaced frames of a video (a [F, H, W, 3] uint8 array, a list of images, or a file read
    with imageio) as consecutive images."""
    return Image(tuple(sample_frames(video, num_frames)), kind="video")


def system(expr=None):
    return role("system", expr)


def user(expr=None):
    return role("user", expr)


def assistant(expr=None):
    return role("assistant", expr)


def system_begin():
    return RoleBegin("system")


def system_end():
    return RoleEnd("system")


def user_begin():
    return RoleBegin("user")


def user_end():
    return RoleEnd("user")


def assistant_begin():
    return RoleBegin("assistant")


def assistant_end():
    return RoleEnd("assistant")
