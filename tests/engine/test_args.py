"""SGLang's launch-line spellings reach the engine: --dtype's names, --kv-cache-dtype, --chat-template,
--tokenizer-path; what sgjax cannot do fails at start with one line naming it."""

import dataclasses

import pytest

from sgjax.engine.args import ServerArgs
from sgjax.engine.engine import Engine
from sgjax.engine.plan import activation_dtype
from sgjax.errors import RequestError
from sgjax.model import chat_templates
from tests.engine.conftest import tiny_engine


@pytest.mark.parametrize(
    "given, want",
    [("auto", "float32"), (None, "float32"), ("float", "float32"), ("float32", "float32"), ("bfloat16", "bfloat16")],
)
def test_dtype_spellings(given, want):
    assert activation_dtype(ServerArgs(dtype=given), "cpu") == want  # CPU: auto is float32


@pytest.mark.parametrize("given", ["half", "float16"])
def test_float16_is_refused_by_name(given):
    with pytest.raises(ValueError, match=f"dtype '{given}': float16 is not supported"):
        Engine(dtype=given)


@pytest.mark.parametrize("peer", ["xgrammar", "outlines", "llguidance"])
def test_a_peer_grammar_backend_is_refused_by_name(peer):
    with pytest.raises(ValueError, match=f"grammar_backend '{peer}' is not supported"):
        Engine(grammar_backend=peer)


def test_grammar_backend_none_refuses_constrained_requests_and_serves_the_rest(tiny):
    with tiny_engine(tiny, grammar_backend="none") as eng:
        for field, params in [("regex", {"regex": "a+"}), ("json_schema", {"json_schema": '{"type": "string"}'})]:
            with pytest.raises(RequestError, match="grammar_backend 'none'") as e:
                eng.generate("hi", {"max_new_tokens": 2, **params})
            assert e.value.field == field
        assert eng.generate("hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2


def test_chat_template_by_name_or_file_and_tokenizer_path(smollm2_path, tmp_path):
    with Engine(chat_template="llama-3", tokenizer_path=smollm2_path, max_total_tokens=1024) as eng:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "<|start_header_id|>user<|end_header_id|>" in text and text.endswith("assistant<|end_header_id|>\n\n")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    assert chat_templates.resolve(str(f)).startswith("{% for m")
    with pytest.raises(ValueError, match="chat_template 'nope': neither a built-in template"):
        chat_templates.resolve("nope")


def test_every_new_flag_is_a_server_args_field():
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert {"kv_cache_dtype", "tokenizer_path", "chat_template", "trust_remote_code", "enable_mixed_chunk"} <= names
