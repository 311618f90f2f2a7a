"""Built-in chat templates for `--chat-template NAME` (jinja, rendered like transformers renders a tokenizer's own),
and loading one from a file. The tokenizer's own template is the default; these are for checkpoints without one or
with the wrong one."""

from __future__ import annotations

import dataclasses
import os

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Gemma's turns: no system role (a system message opens the first user turn, as Gemma's own template does), the
# assistant is "model", each turn ends with <end_of_turn>.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

BUILTIN = {
    "chatml": CHATML,
    "qwen": CHATML,
    "llama-3": LLAMA3,
    "llama-3-instruct": LLAMA3,
    "gemma": GEMMA,
    "gemma-it": GEMMA,
}
# Tokens that end an assistant turn in a built-in template, added to the model's stop tokens with it (a GGUF
# conversion without a template usually lacks its generation config too: Gemma's lists <end_of_turn> beside <eos>).
TURN_END = {"gemma": "<end_of_turn>", "gemma-it": "<end_of_turn>"}


def with_template(tokenizer, name_or_path: str | None, architecture: str):
    """The tokenizer with `--chat-template` applied; without one, a checkpoint that has no template of its own gets
    its family's built-in (families.py), with that template's turn-end token among the stop tokens."""
    from sgjax.model.families import FAMILY

    if not name_or_path:
        family = FAMILY.get(architecture)
        if tokenizer.chat_template or family is None or family.chat_template is None:
            return tokenizer
        name_or_path = family.chat_template
    changes = {"chat_template": resolve(name_or_path)}
    end = TURN_END.get(name_or_path)
    end_id = tokenizer.token_to_id(end) if end else None
    if end_id is not None and end_id not in tokenizer.eos_token_ids:
        changes["eos_token_ids"] = (*tokenizer.eos_token_ids, end_id)
    return dataclasses.replace(tokenizer, **changes)


def resolve(name_or_path: str) -> str:
    """The jinja source of a built-in template name or of a template file."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            return f.read()
    raise ValueError(
        f"chat_template {name_or_path!r}: neither a built-in template ({', '.join(sorted(BUILTIN))}) nor a file"
    )
