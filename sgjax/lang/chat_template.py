"""Role markers (`system`/`user`/`assistant` begin and end strings) taken from the model's own chat template.

The interpreter builds a prompt piece by piece, so it needs each role's prefix and suffix rather than a renderer
of whole conversations. We get them by rendering the model's template (jinja, via the tokenizer) over short
conversations with marker contents and cutting the output at the markers; the default system prompt a template
inserts when a conversation has none is found the same way. A model without a template, or one whose template
cannot be cut this way, gets the plain template below.

`get_chat_template(name)` looks up a few of SGLang's named templates (its `sglang.lang.chat_template` registry,
for programs that set `backend.chat_template = get_chat_template("chatml")`), and
`get_chat_template_by_model_path(path)` derives the template from the model's own tokenizer, as the backends do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
_MARK = {"system": "SGJAXSYSTEMMARK", "user": "SGJAXUSERMARK", "assistant": "SGJAXASSISTANTMARK"}


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict  # role -> (prefix, suffix)
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = field(default=())  # added to every gen's stop strings
    # what the prompt text holds where an image goes (LLaVA's placeholder; a vision model's processor expands it)
    image_token: str = "<image>"
    # "llama2": Llama-2's first system message opens the user's [INST] and the first user message continues it
    style: str = "plain"

    def get_prefix_and_suffix(self, role: str, hist_messages: list | None = None) -> tuple[str, str]:
        """The role's markers; `hist_messages` (the messages before this one, SGLang's second argument) matters
        only for the llama2 style."""
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; roles: {sorted(self.roles)}")
        prefix, suffix = self.roles[role]
        if self.style == "llama2" and hist_messages is not None:
            if role == "system" and not hist_messages:
                return self.roles["user"][0] + prefix, suffix
            if role == "user" and len(hist_messages) == 1 and hist_messages[0]["role"] == "system":
                return "", suffix
        return prefix, suffix

    @property
    def role_prefix_and_suffix(self) -> dict:  # SGLang's name for `roles`
        return self.roles


PLAIN = ChatTemplate("plain", {"system": ("", "\n\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "\n")})


def from_tokenizer(tokenizer) -> ChatTemplate:
    """The role markers of a tokenizer's chat template (sgjax.model.tokenizer.Tokenizer), or PLAIN."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return PLAIN

    def render(messages, add_generation_prompt=False):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    try:
        return derive(render)
    except Exception:  # a template that raises on our probes (e.g. no system role) or does not split cleanly
        return PLAIN


def derive(render) -> ChatTemplate:
    """Cut role prefixes and suffixes out of `render(messages, add_generation_prompt)`."""

    def msg(role):
        return {"role": role, "content": _MARK[role]}

    s_only = render([msg("system")])
    su = render([msg("system"), msg("user")])
    sua = render([msg("system"), msg("user"), msg("assistant")])
    if not (su.startswith(s_only) and sua.startswith(su)):
        raise ValueError("the template does not render conversations as concatenated messages")
    roles = {
        "system": _split(s_only, "system"),
        "user": _split(su[len(s_only) :], "user"),
        "assistant": _split(sua[len(su) :], "assistant"),
    }
    generation_prompt = render([msg("system"), msg("user")], add_generation_prompt=True)[len(su) :]
    if generation_prompt and generation_prompt != roles["assistant"][0]:
        raise ValueError("the generation prompt differs from the assistant prefix")
    stop = roles["assistant"][1].strip()
    return ChatTemplate("model", roles, _default_system(render, roles), (stop,) if stop else ())


def _split(text: str, role: str) -> tuple[str, str]:
    prefix, sep, suffix = text.partition(_MARK[role])
    if not sep or _MARK[role] in suffix:
        raise ValueError(f"the {role} message does not appear exactly once")
    return prefix, suffix


def _default_system(render, roles) -> str | None:
    """The system prompt the template adds to a conversation without one (SmolLM2 has one), if any."""
    user_prefix, user_suffix = roles["user"]
    text = render([{"role": "user", "content": _MARK["user"]}])
    tail = user_prefix + _MARK["user"] + user_suffix
    if text == tail or not text.endswith(tail):
        return None
    head = text[: -len(tail)]
    sys_prefix, sys_suffix = roles["system"]
    if head.startswith(sys_prefix) and head.endswith(sys_suffix) and len(head) >= len(sys_prefix) + len(sys_suffix):
        return head[len(sys_prefix) : len(head) - len(sys_suffix)]
    return None


# SGLang's named templates that programs ask for by name: the markers of each model family's format.
_IM = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}
_LLAMA3 = {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES}
REGISTRY = {
    t.name: t
    for t in (
        PLAIN,
        ChatTemplate(
            "default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}
        ),
        ChatTemplate("claude", {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")}),
        ChatTemplate("chatml", _IM, stop_str=("<|im_end|>",)),
        ChatTemplate("qwen", _IM, "You are a helpful assistant.", ("<|im_end|>",)),
        ChatTemplate(
            "vicuna_v1.1",
            {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
            "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
            "helpful, detailed, and polite answers to the user's questions.",
            image_token=" <image>\n",
        ),
        ChatTemplate(
            "llama-2-chat",
            {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s><s>")},
            style="llama2",
        ),
        ChatTemplate("llama-3-instruct", _LLAMA3, stop_str=("<|eot_id|>",), image_token="<|image|>"),
    )
}


def get_chat_template(name: str) -> ChatTemplate:
    """One of SGLang's named templates (REGISTRY); "plain" is sgjax's default."""
    if name not in REGISTRY:
        raise KeyError(
            f"no chat template {name!r}; sgjax has {sorted(REGISTRY)} (a model's own template comes from "
            f"its tokenizer: get_chat_template_by_model_path)"
        )
    return REGISTRY[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    """The template of the model at `model_path`, cut from its tokenizer's own chat template (PLAIN without one)."""
    from sgjax.model.tokenizer import load_tokenizer

    return from_tokenizer(load_tokenizer(model_path))
