"""Shared test set-up: CPU JAX with a persistent compilation cache, and session-scoped models."""

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = os.environ.get(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache")
)
_TEST_CACHE = os.path.join(os.path.dirname(os.path.dirname(__file__)), ".test_cache")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Host devices for the tensor-parallel tests (tests/engine/test_tp.py), set before anything starts jax's backend.
# Everything else still runs on device 0 (jax's default placement); SGJAX_TEST_CPU_DEVICES=1 turns it off.
# The child processes the tests start (servers, routers' workers, the benchmark CLI) get as many through the
# environment (a flag such as --tp-size still names its own): the persistent cache's keys hash the process's device
# topology, so a one-device child missed every program the test workers had compiled, and they its.
_DEVICES = os.environ.get("SGJAX_TEST_CPU_DEVICES", "4")
os.environ["JAX_NUM_CPU_DEVICES"] = _DEVICES
jax.config.update("jax_num_cpu_devices", int(_DEVICES))


# One engine config for the tests' in-process engines and test servers (tests/server/conftest.py's SMALL_FLAGS):
# engines of one model with the same pool and step settings share the jitted step's compiled executables in the
# process (sgjax/engine/runner.py `jitted_step`), and servers load them from the persistent cache.
SMALL = dict(max_total_tokens=4096, chunked_prefill_size=96, max_running_requests=8)


@pytest.fixture(scope="session")
def smollm2_path():
    from sgjax.model.paths import default_model_path

    return default_model_path()


def _written_again(smollm2_path, tmp_path_factory, qtype):
    from sgjax.model.gguf_write import requantize

    path = str(tmp_path_factory.mktemp(qtype.lower()) / f"SmolLM2-135M-Instruct.{qtype}.gguf")
    requantize(smollm2_path, path, qtype)
    return path


@pytest.fixture(scope="session")
def smollm2_q8_0_path(smollm2_path, tmp_path_factory):
    """The default SmolLM2 written again with every matrix as GGUF Q8_0 blocks (model/gguf_write.py; ~4 s), as
    llama.cpp's Q8_0 files store them: no such model installs here."""
    return _written_again(smollm2_path, tmp_path_factory, "Q8_0")


@pytest.fixture(scope="session")
def smollm2_q4_0_path(smollm2_path, tmp_path_factory):
    """The same with every matrix as Q4_0 blocks (a step per 32 weights, no minimum)."""
    return _written_again(smollm2_path, tmp_path_factory, "Q4_0")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from sgjax.model.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_tokenizer):
    """Our fp32 SmolLM2 (config, weights as loaded) and tokenizer, loaded once per session: through the engine's
    cache under the key `Engine(dtype="float32")` loads the default model from, so the tests and their engines hold
    one copy."""
    from sgjax.engine.loading import load_model_cached

    cfg, weights = load_model_cached(None, "float32")
    return cfg, weights, smollm2_tokenizer


@pytest.fixture(scope="session")
def tiny(smollm2_tokenizer):
    """(config, weights, tokenizer) of the tiny random model with SmolLM2's tokenizer (TINY_SMOLLM2_VOCAB): for tests
    that compare sgjax with itself, where the real model's compute would only cost time."""
    from sgjax.model.presets import TINY_SMOLLM2_VOCAB
    from sgjax.model.weights import dummy_weights

    return TINY_SMOLLM2_VOCAB, dummy_weights(TINY_SMOLLM2_VOCAB), smollm2_tokenizer


@pytest.fixture(scope="session")
def server():
    """One real `sgjax serve` (SmolLM2, the SMALL settings, metrics on) for tests/server and tests/lang: started
    once per session, it must exit cleanly on SIGTERM at the end. Tests that need other flags start their own."""
    from tests.server.conftest import SMALL_FLAGS, serving

    yield from serving(*SMALL_FLAGS, "--enable-metrics")


@pytest.fixture(scope="session")
def url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def client(url):
    import httpx

    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@contextlib.contextmanager
def gguf_read_once():
    """Within this, HF transformers' GGUF loads share one gguf-py reader per file. HF parses a GGUF's metadata anew
    for each of a model's config, its weights and a tokenizer (modeling_gguf_pytorch_utils.load_gguf_checkpoint
    makes a GGUFReader, which walks every vocabulary entry: ~8 s a parse for Gemma 3's 262144 tokens); the reader
    only maps the file read-only, so what HF builds from it is the same."""
    import gguf

    if getattr(gguf.GGUFReader, "shared", False):  # inside another: that one's readers serve
        yield
        return
    real, made = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in made:
            made[key] = real(path, mode)
        return made[key]

    reader.shared = True
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def hf_from_gguf(gguf_path: str):
    """HF transformers' causal LM read from a GGUF (torch CPU, fp32, dequantized): the numerical reference.

    HF's GGUF read is ~20 s a load (its reader walks the whole vocabulary's metadata three times), and several test
    files in both workers want the same model: the first load in a run saves what HF read (`save_pretrained`, the
    same fp32 tensors and config) under .test_cache/hf, and the others load that (0.1 s), one at a time under a
    file lock."""
    import fcntl

    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    torch.set_num_threads(2)
    st = os.stat(gguf_path)
    name = f"{os.path.basename(gguf_path)}-{st.st_size}-{int(st.st_mtime)}"
    saved = os.path.join(_TEST_CACHE, "hf", name)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(saved):
            d, f = os.path.split(gguf_path)
            with gguf_read_once():  # its config and its weights: one parse of the file
                model = AutoModelForCausalLM.from_pretrained(
                    d, gguf_file=f, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
                )
            model.save_pretrained(saved + ".part")
            os.replace(saved + ".part", saved)  # whole or absent, should this process die while saving
            return model.eval()
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids=None):
    """HF transformers' greedy continuation (new token ids, through the first of the stop ids when one comes) of
    every prompt, from one batched `generate` (prompts left-padded under an attention mask, as HF batches them):
    decoding reads the weights once a step for all the prompts, not once a prompt (the same tokens as one generate
    a prompt). Stop ids: the model's generation config's EOS unless `eos_token_ids` names
    them; () for none (every row runs max_new_tokens)."""
    import torch

    width, pad = max(map(len, prompts)), 0
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    if eos_token_ids is None:
        eos_token_ids = model.generation_config.eos_token_id
    stops = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
    with torch.no_grad():
        seqs = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=pad,
        )
    out = []
    for row in seqs[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        out.append(row[: ends[0] + 1] if ends else row)
    return out


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' SmolLM2 from the same GGUF (torch CPU, fp32): the numerical reference."""
    return hf_from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """The tiny random LLaVA checkpoint directory with its tokenizer (tests/llava_tiny.py), the HF model, and our
    load of it: shared by the model, engine and server tests."""
    from sgjax.model import vision as V
    from tests.llava_tiny import write_checkpoint

    path = str(tmp_path_factory.mktemp("llava"))
    hf = write_checkpoint(path)
    return path, hf, V.load_llava_dir(path)


# A checkpoint directory of only a config: `sgjax serve --load-format dummy` children build its random weights (the
# same values on every mesh), with SmolLM2's tokenizer. 4 heads on 2 KV heads split 2 or 4 ways (SmolLM2's 9 do not).
TINY_CHECKPOINT = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
# Its servers' settings, and the in-process engine that gives them their reference answers.
TINY_SERVE = dict(max_total_tokens=1024, chunked_prefill_size=64, max_running_requests=4)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    import json

    d = tmp_path_factory.mktemp("tiny-checkpoint")
    (d / "config.json").write_text(json.dumps(TINY_CHECKPOINT))
    return str(d)
