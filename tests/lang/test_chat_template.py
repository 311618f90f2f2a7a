"""Role markers cut out of the model's chat template."""

import dataclasses

import pytest

from sgjax.lang.chat_template import PLAIN, from_tokenizer
from sgjax.model.tokenizer import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You judge essays."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Grade it."},
]
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NO_SYSTEM_ROLE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
)


def compose(template, messages):
    return "".join(
        template.get_prefix_and_suffix(m["role"])[0] + m["content"] + template.get_prefix_and_suffix(m["role"])[1]
        for m in messages
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_smollm2_roles_rebuild_what_the_template_renders(tokenizer):
    t = from_tokenizer(tokenizer)
    assert t.name == "model"
    assert compose(t, CONVERSATION) == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert t.get_prefix_and_suffix("assistant") == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.stop_str == ("<|im_end|>",)
    # Without a system message, SmolLM2's template adds its own: the interpreter must add the same text.
    assert t.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    user_only = [{"role": "system", "content": t.default_system_prompt}] + CONVERSATION[1:]
    assert compose(t, user_only) == tokenizer.apply_chat_template(CONVERSATION[1:], add_generation_prompt=False)


def test_a_template_with_bos_and_no_default_system_prompt(tokenizer):
    tok = dataclasses.replace(tokenizer, chat_template=LLAMA3_LIKE)
    t = from_tokenizer(tok)
    assert t.default_system_prompt is None
    assert t.get_prefix_and_suffix("system")[0].startswith("<|im_start|><|start_header_id|>system")
    assert compose(t, CONVERSATION) == tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)


def test_templates_that_cannot_be_cut_fall_back_to_the_plain_one(tokenizer):
    assert from_tokenizer(dataclasses.replace(tokenizer, chat_template=NO_SYSTEM_ROLE)) is PLAIN
    assert from_tokenizer(dataclasses.replace(tokenizer, chat_template=None)) is PLAIN
    assert from_tokenizer(None) is PLAIN
    with pytest.raises(ValueError, match="no role 'tool'"):
        PLAIN.get_prefix_and_suffix("tool")


def test_sglangs_named_templates_and_the_lookup_by_model_path(tokenizer):
    from sgjax.lang.chat_template import get_chat_template, get_chat_template_by_model_path
    from sgjax.model.paths import resolve_model_path

    chatml = get_chat_template("chatml")
    assert chatml.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert chatml.stop_str == ("<|im_end|>",) and get_chat_template("qwen").default_system_prompt
    assert get_chat_template("default").get_prefix_and_suffix("user", []) == ("USER:", "\n")  # SGLang's 2 args
    with pytest.raises(KeyError, match="no chat template 'nope'"):
        get_chat_template("nope")
    assert get_chat_template_by_model_path(resolve_model_path(None)) == from_tokenizer(tokenizer)


def test_the_llama2_template_opens_inst_once_for_a_system_and_a_user_message():
    import sgjax as sgl
    from sgjax.lang.chat_template import get_chat_template
    from tests.lang.fakes import FakeBackend

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a"))
        s += sgl.user("Bye")

    state = chat.run(backend=FakeBackend(reply=lambda t, p: "Hello", template=get_chat_template("llama-2-chat")))
    assert state.text() == "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]Hello </s><s>[INST] Bye [/INST]"
    assert [m["content"] for m in state.messages()] == ["Be brief.", "Hi", "Hello", "Bye"]
