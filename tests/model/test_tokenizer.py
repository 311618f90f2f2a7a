"""SmolLM2's tokenizer, built from the GGUF with `tokenizers` only, against HF transformers on real texts."""

import itertools
import os

import pytest
from tokenizers import pre_tokenizers

from sgjax import data
from sgjax.model.tokenizer import load_tokenizer


def _real_texts(n_each=80):
    texts = [d["question"] for d in data.gsm8k()[:n_each]]  # numbers everywhere
    texts += [d["query"] for d in data.squad()[:n_each]]  # Wikipedia prose
    turns = (t["value"] for c in data.sharegpt(limit=400) for t in c["conversations"])
    texts += list(itertools.islice((t for t in turns if 0 < len(t) < 4000), n_each))  # chat, code, unicode
    return texts


@pytest.fixture(scope="module")
def reference(smollm2_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm2_path)
    hf = AutoTokenizer.from_pretrained(d, gguf_file=f)
    # transformers' GGUF converter drops SmolLM2's digit split; the model's own tokenizer.json (and
    # llama.cpp's `smollm` pre-tokenizer) split digits first: put that pre-tokenizer back.
    fixed = AutoTokenizer.from_pretrained(d, gguf_file=f)
    fixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return hf, fixed


def test_parity_on_real_texts(smollm2_path, reference):
    hf, fixed = reference
    ours = load_tokenizer(smollm2_path)
    texts = _real_texts()
    assert len(texts) >= 200
    digit_split_mattered = 0
    for text in texts:
        ids = ours.encode(text)
        assert ids == fixed.encode(text, add_special_tokens=False), text[:80]
        if ids != hf.encode(text, add_special_tokens=False):
            assert any(ch.isdigit() for ch in text), "only the digit split may differ from transformers"
            digit_split_mattered += 1
        assert ours.decode(ids) == text
    assert digit_split_mattered > 0


def test_special_tokens_and_chat_template(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.encode("<|im_start|>user")[0] == 1
    assert tok.encode("22 + 33") == [34, 34, 1232, 216, 35, 35]  # digits one by one, as llama.cpp's smollm
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
