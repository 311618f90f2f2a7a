"""Shared test set-up: CPU JAX with a persistent compilation cache, and session-scoped models."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR",
                        os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def smollm2_path():
    from sgjax.model.paths import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our fp32 SmolLM2 (config, weights) and tokenizer, loaded once per session."""
    from sgjax.model.loader import load_model
    from sgjax.model.tokenizer import load_tokenizer

    cfg, weights = load_model(smollm2_path)
    return cfg, weights, load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' SmolLM2 from the same GGUF (torch CPU, fp32): the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    torch.set_num_threads(2)
    d, f = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    return model.eval()


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """The tiny random LLaVA checkpoint directory with its tokenizer (tests/llava_tiny.py), the HF model, and our
    load of it: shared by the model, engine and server tests."""
    from sgjax.model import vision as V
    from tests.llava_tiny import write_checkpoint

    path = str(tmp_path_factory.mktemp("llava"))
    hf = write_checkpoint(path)
    return path, hf, V.load_llava_dir(path)
