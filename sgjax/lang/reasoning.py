"""Splitting a reasoning model's output into its reasoning and its answer (`sgl.separate_reasoning`).

Reasoning models write their thinking between `<think>` and `</think>` before the answer. Two formats exist, and
the model type (SGLang's reasoning-parser names) says which one a model uses:

- *forced*: the model always reasons first and may omit the opening tag (DeepSeek-R1 starts inside the block), so
  everything before `</think>` is reasoning; an output without `</think>` was cut off while reasoning, so all of it
  is reasoning and the answer is empty.
- *optional*: the model reasons only when it opens a `<think>` block (Qwen3 with thinking on or off); an output
  that opens none is all answer.

`model_type=None` (sgjax's default) is the optional format: on a model that never writes `<think>` the reasoning
is empty and the answer is the whole output. An unknown model type is a ValueError when the program runs (SGLang
accepts any name when the expression is built, and its parser refuses it when run).
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"

# SGLang's model types whose format is <think>...</think>, by format.
FORCED = ("deepseek-r1", "step3", "step3p5", "gigachat35", "qwen3-thinking", "minimax")
OPTIONAL = ("qwen3", "dots", "nanbeige", "interns1", "glm45", "kimi")


def is_forced(model_type: str | None) -> bool:
    if model_type is None:
        return False
    name = model_type.lower()
    if name in FORCED:
        return True
    if name in OPTIONAL:
        return False
    raise ValueError(
        f"separate_reasoning: unsupported model type {model_type!r}; sgjax knows "
        f"{sorted(FORCED + OPTIONAL)} (or None: reasoning only inside <think>...</think>)"
    )


def split_reasoning(text: str, model_type: str | None = None) -> tuple[str, str]:
    """(reasoning, answer) of a model's output."""
    forced = is_forced(model_type)
    if not forced and THINK_START not in text:
        return "", text
    body = text
    while body.startswith(THINK_START):  # the opening tag(s), when the model wrote them
        body = body[len(THINK_START) :]
    if THINK_END not in body:
        return body, ""  # cut off while reasoning
    reasoning, _, answer = body.partition(THINK_END)
    return reasoning, answer
