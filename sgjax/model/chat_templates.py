"""Built-in chat templates for `--chat-template NAME` (jinja, rendered like transformers renders a tokenizer's own),
and loading one from a file. The tokenizer's own template is the default; these are for checkpoints without one or
with the wrong one."""

from __future__ import annotations

import os

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

BUILTIN = {"chatml": CHATML, "qwen": CHATML, "llama-3": LLAMA3, "llama-3-instruct": LLAMA3}


def resolve(name_or_path: str) -> str:
    """The jinja source of a built-in template name or of a template file."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            return f.read()
    raise ValueError(f"chat_template {name_or_path!r}: neither a built-in template ({', '.join(sorted(BUILTIN))}) "
                     f"nor a file")
