"""Role markers (`system`/`user`/`assistant` begin and end strings) taken from the model's own chat template.

The interpreter builds a prompt piece by piece, so it needs each role's prefix and suffix rather than a renderer
of whole conversations. We get them by rendering the model's template (jinja, via the tokenizer) over short
conversations with marker contents and cutting the output at the markers; the default system prompt a template
inserts when a conversation has none is found the same way. A model without a template, or one whose template
cannot be cut this way, gets the plain template below (what SGLang calls "default").
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

    def get_prefix_and_suffix(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; roles: {sorted(self.roles)}")
        return self.roles[role]


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
    roles = {"system": _split(s_only, "system"), "user": _split(su[len(s_only):], "user"),
             "assistant": _split(sua[len(su):], "assistant")}
    generation_prompt = render([msg("system"), msg("user")], add_generation_prompt=True)[len(su):]
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
    head = text[:-len(tail)]
    sys_prefix, sys_suffix = roles["system"]
    if head.startswith(sys_prefix) and head.endswith(sys_suffix) and len(head) >= len(sys_prefix) + len(sys_suffix):
        return head[len(sys_prefix):len(head) - len(sys_suffix)]
    return None
