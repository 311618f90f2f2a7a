"""The LLaVA vision half against transformers on a tiny random checkpoint (fp32; the session fixture `llava` of
tests/conftest.py): tower + projector, the merged prompt through our Llama forward over the paged pool, CLIP
preprocessing, and the placeholder merge."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlavaConfig

from sgjax.kernels import allocate_pool, ref_attention
from sgjax.model import vision as V
from sgjax.model.batch import build_batch
from tests.llava_tiny import IMAGE_TOKEN
from tests.model.steps import make_step

PAGE, PAGES_PER_REQ, NUM_PAGES = 4, 16, 40


def _images(vcfg, n, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(41, 57), (64, 37), (32, 32)]
    return np.stack(
        [V.preprocess(rng.integers(0, 256, size=(*shapes[i % 3], 3), dtype=np.uint8), vcfg) for i in range(n)]
    )


def test_config_and_names(llava):
    path, hf, (tcfg, _, vcfg, vw) = llava
    assert (vcfg.image_size, vcfg.patch_size, vcfg.num_layers, vcfg.layers_used) == (32, 8, 3, 2)
    assert (vcfg.hidden_act, vcfg.projector_act, vcfg.image_token_index) == ("quick_gelu", "gelu", IMAGE_TOKEN)
    assert vcfg.num_image_tokens == 16 and tcfg.hidden_size == vcfg.text_hidden_size == 64
    assert vw.layers.wq.shape == (2, 32, 32)  # the last layer is past the feature layer: not loaded
    for old, new in [
        ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"),
        ("model.vision_tower.vision_model.pre_layrnorm.bias", "vision_tower.pre_layrnorm.bias"),
        ("model.multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_1.weight"),
        ("language_model.model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("model.language_model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]:
        assert V.canonical_name(old) == new


@pytest.mark.parametrize("style", ["llava-hf", "in-memory"])
def test_loads_other_tensor_name_styles(llava, tmp_path, style):
    """llava-hf's `vision_tower.vision_model.*` names and transformers' in-memory `model.*` names load the same."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import save_file

    path, _, loaded = llava
    with safe_open(f"{path}/model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def rename(k):
        if style == "llava-hf":
            return k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        if k.startswith("language_model.model."):
            return "model.language_model." + k[len("language_model.model.") :]
        return k[len("language_model.") :] if k.startswith("language_model.lm_head") else "model." + k

    renamed = {rename(k): v for k, v in tensors.items()}
    assert len(renamed) == len(tensors) and set(renamed) != set(tensors)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    again = V.load_llava_dir(str(tmp_path))
    assert again[0] == loaded[0] and again[2] == loaded[2]
    for a, b in zip(jax.tree.leaves(again[1:]), jax.tree.leaves(loaded[1:])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "full"), (1, "default")])
def test_image_features_match_hf(llava, layer, strategy):
    path, hf, (_, _, vcfg, _) = llava
    cfg = dataclasses.replace(vcfg, vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    get, names = V._open_safetensors(path)
    vw = V.vision_weights_from_state_dict(cfg, get, names)
    pixels = _images(cfg, 2)
    ours = np.asarray(jax.jit(V.encode_images, static_argnums=1)(vw, cfg, jnp.asarray(pixels)))
    with torch.no_grad():
        out = hf.model.get_image_features(
            torch.from_numpy(pixels), vision_feature_layer=layer, vision_feature_select_strategy=strategy
        )
    ref = torch.stack(list(out.pooler_output)).numpy()
    assert ours.shape == ref.shape == (2, cfg.num_image_tokens, 64)
    err = np.abs(ours - ref).max()
    print(f"image features max abs error {err:.2e} (features up to {np.abs(ref).max():.1f})")
    assert err < 1e-4 * max(1.0, np.abs(ref).max()), err


def _prompt(n_images, ntok):
    ids = [1, 17, 42]
    for i in range(n_images):
        ids += [IMAGE_TOKEN] * ntok + [9 + i, 11, 13 + 2 * i]
    return ids


@pytest.mark.parametrize("n_images", [1, 2])
def test_end_to_end_logits_match_hf(llava, n_images):
    """Prompt with image placeholders -> merged embeddings -> our paged forward == HF LLaVA, in two prefill chunks
    (the split falls inside the first image's rows, as a chunked prefill or a cached prefix would cut it)."""
    path, hf, (tcfg, tw, vcfg, vw) = llava
    ids = _prompt(n_images, vcfg.num_image_tokens)
    pixels = _images(vcfg, n_images, seed=n_images)
    feats = V.encode_images(vw, vcfg, jnp.asarray(pixels)).reshape(-1, tcfg.hidden_size)
    embeds = V.merge_image_features(tw.embed[jnp.asarray(ids)], jnp.asarray(ids), feats, vcfg.image_token_index)

    step = make_step(tcfg, ref_attention)
    pool = allocate_pool(tcfg.num_layers, NUM_PAGES, PAGE, tcfg.num_kv_heads, tcfg.head_dim)
    table = [list(np.random.default_rng(0).permutation(np.arange(1, NUM_PAGES))[:PAGES_PER_REQ])]
    T = 48
    split = 10
    outs = []
    for lo, hi in ((0, split), (split, len(ids))):
        rows = list(range(hi - lo))
        batch = build_batch([ids[lo:hi]], [hi], table, PAGE, T, 1, PAGES_PER_REQ, logits_rows=rows, num_logits=T)
        x = jnp.zeros((T, tcfg.hidden_size), jnp.float32).at[: hi - lo].set(embeds[lo:hi])
        logits, pool = step(tw, pool, jax.tree.map(jnp.asarray, batch), input_embeds=x)
        outs.append(np.asarray(logits)[: hi - lo])
    ours = np.concatenate(outs)

    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels)).logits[0].numpy()
        other = (
            hf(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels[::-1].copy() * 0.5))
            .logits[0]
            .numpy()
        )
    assert np.abs(other[-1] - ref[-1]).max() > 0.1  # the image changes the prediction, so the test can fail
    err = np.abs(ours - ref).max()
    print(f"end-to-end max abs logit error {err:.2e} (logits up to {np.abs(ref).max():.1f})")
    assert err < 1e-4 * max(1.0, np.abs(ref).max()), err
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))  # greedy next tokens at every position


def test_preprocess_matches_clip_image_processor(llava):
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    _, _, (_, _, vcfg, _) = llava
    rng = np.random.default_rng(3)
    worst = 0.0
    for size, shape in [(32, (41, 57)), (32, (90, 33)), (224, (300, 401)), (224, (224, 224)), (32, (20, 25))]:
        cfg = dataclasses.replace(vcfg, image_size=size, patch_size=size // 4)
        proc = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
        img = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
        for inp in (img, Image.fromarray(np.concatenate([img, np.full((*shape, 1), 128, np.uint8)], -1), "RGBA")):
            ours = V.preprocess(inp, cfg)
            ref = proc(inp, return_tensors="np")["pixel_values"][0]
            assert ours.shape == ref.shape == (3, size, size)
            np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)
            worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"preprocess max abs error {worst:.1e}")


def test_merge_image_features_two_images():
    D, ph = 3, 7
    ids = jnp.array([1, ph, ph, 5, 6, ph, ph, 8, 0, 0], jnp.int32)  # two 2-row images, text between, padding after
    embeds = jnp.arange(10 * D, dtype=jnp.float32).reshape(10, D)
    feats = -1.0 - jnp.arange(4 * D, dtype=jnp.float32).reshape(4, D)
    out = np.asarray(jax.jit(V.merge_image_features, static_argnums=3)(embeds, ids, feats, ph))
    expect = np.asarray(embeds).copy()
    expect[[1, 2, 5, 6]] = np.asarray(feats)
    np.testing.assert_array_equal(out, expect)
    # no placeholders: the embeddings pass through unchanged
    np.testing.assert_array_equal(V.merge_image_features(embeds, ids, feats, 99), embeds)
    np.testing.assert_array_equal(V.merge_image_features(embeds, ids, feats[:0], 99), embeds)


def test_llava15_style_config_reads_transformers_defaults():
    """llava-1.5's config.json leaves most fields at the transformers defaults; we read what transformers reads."""
    d = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 32000,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vision_config": {
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "model_type": "clip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "max_position_embeddings": 4096,
            "model_type": "llama",
            "rms_norm_eps": 1e-05,
            "vocab_size": 32064,
        },
    }
    vcfg, tcfg = V.vision_config_from_hf(d), V.text_config_from_llava(d)
    hf = LlavaConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert (vcfg.num_image_tokens, vcfg.layers_used, vcfg.hidden_act) == (576, 23, hf.vision_config.hidden_act)
    assert vcfg.layer_norm_eps == hf.vision_config.layer_norm_eps
    t = hf.text_config
    assert (
        tcfg.hidden_size,
        tcfg.num_layers,
        tcfg.num_heads,
        tcfg.num_kv_heads,
        tcfg.intermediate_size,
        tcfg.vocab_size,
    ) == (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size, 32064)
    with pytest.raises(V.UnsupportedModelError):
        V.vision_config_from_hf({**d, "vision_feature_layer": [-2, -5]})
