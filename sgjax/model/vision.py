"""The vision half of a LLaVA-style model: CLIP vision tower + multi-modal projector, as pure functions.

`encode_images` turns preprocessed pixels into rows of the language model's embedding space; `merge_image_features`
writes them over the image-placeholder tokens of a prompt, and `llama.forward(..., input_embeds=...)` runs the text
model on the result. Preprocessing (`preprocess`) runs on the host in numpy, as CLIP's image processor does.
See docs/vision.md.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model import weights as W
from sgjax.model.checkpoint import config_from_hf
from sgjax.model.config import ModelConfig, UnsupportedModelError

Array = Any

# OpenAI CLIP's normalisation constants (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Older LLaVA config.json files (e.g. llava-hf/llava-1.5-7b-hf) leave fields at the transformers defaults; these
# are CLIPVisionConfig's and LlamaConfig's defaults so that such files read the same as transformers reads them.
_CLIP_DEFAULTS = dict(
    image_size=224,
    patch_size=32,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    layer_norm_eps=1e-5,
    hidden_act="quick_gelu",
    num_channels=3,
)
_LLAMA_DEFAULTS = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    model_type="llama",
)


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP vision transformer and LLaVA's projector; frozen and hashable (a static jit argument)."""

    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # the tower's depth in the checkpoint (we only keep the layers the features need)
    num_heads: int
    text_hidden_size: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    projector_act: str = "gelu"
    projector_bias: bool = True
    vision_feature_layer: int = -2  # index into the tower's hidden states (0 = after the pre-layernorm)
    vision_feature_select_strategy: str = "default"  # "default" drops the CLS token, "full" keeps it
    image_token_index: int = 32000
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise UnsupportedModelError(f"image_size {self.image_size} is not a multiple of patch {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise UnsupportedModelError(f"hidden {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.vision_feature_select_strategy not in ("default", "full"):
            raise UnsupportedModelError(f"vision_feature_select_strategy {self.vision_feature_select_strategy!r}")
        if not -(self.num_layers + 1) <= self.vision_feature_layer <= self.num_layers:
            raise UnsupportedModelError(f"vision_feature_layer {self.vision_feature_layer} is out of range")
        for act in (self.hidden_act, self.projector_act):
            if act not in _ACTS:
                raise UnsupportedModelError(f"activation {act!r} is not supported ({sorted(_ACTS)})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Rows per image in the prompt (the placeholder tokens an image takes)."""
        return self.num_patches + (self.vision_feature_select_strategy == "full")

    @property
    def layers_used(self) -> int:
        # hidden_states has num_layers + 1 entries (the embeddings, then each layer's output), so feature layer k
        # needs exactly k % (num_layers + 1) encoder layers: LLaVA's -2 skips the last layer (and post_layernorm).
        return self.vision_feature_layer % (self.num_layers + 1)


def vision_config_from_hf(d: dict) -> VisionConfig:
    """VisionConfig from an HF LLaVA config.json dict."""
    if d.get("model_type") not in (None, "llava"):
        raise UnsupportedModelError(f"model_type {d.get('model_type')!r} is not a LLaVA model")
    v = {**_CLIP_DEFAULTS, **(d.get("vision_config") or {})}
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise UnsupportedModelError(f"vision tower {v['model_type']!r} is not supported (clip_vision_model)")
    if v["num_channels"] != 3:
        raise UnsupportedModelError("only 3-channel images are supported")
    layer = d.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UnsupportedModelError(f"a list of vision feature layers ({layer}) is not supported")
    text = {**_LLAMA_DEFAULTS, **(d.get("text_config") or {})}
    return VisionConfig(
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"],
        text_hidden_size=text["hidden_size"],
        layer_norm_eps=float(v["layer_norm_eps"]),
        hidden_act=v["hidden_act"],
        projector_act=d.get("projector_hidden_act", "gelu"),
        projector_bias=bool(d.get("multimodal_projector_bias", True)),
        vision_feature_layer=layer,
        vision_feature_select_strategy=d.get("vision_feature_select_strategy", "default"),
        image_token_index=int(d.get("image_token_index", d.get("image_token_id", 32000))),
    )


def text_config_from_llava(d: dict, dtype: str = "float32") -> ModelConfig:
    """The language model's ModelConfig from a LLaVA config.json dict (its text_config)."""
    return config_from_hf({**_LLAMA_DEFAULTS, **(d.get("text_config") or {})}, dtype)


# --- weights ------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclass
class VisionLayerWeights:
    """One CLIP encoder layer, every array with a leading [layers_used] axis; matrices stored (in, out)."""

    ln1_w: Array  # [L, Dv]
    ln1_b: Array
    wq: Array  # [L, Dv, Dv]
    bq: Array  # [L, Dv]
    wk: Array
    bk: Array
    wv: Array
    bv: Array
    wo: Array
    bo: Array
    ln2_w: Array
    ln2_b: Array
    fc1: Array  # [L, Dv, F]
    fc1_b: Array  # [L, F]
    fc2: Array  # [L, F, Dv]
    fc2_b: Array  # [L, Dv]


@jax.tree_util.register_dataclass
@dataclass
class VisionWeights:
    patch_embed: Array  # [3*p*p, Dv]: the conv kernel flattened in (channel, row, col) order
    class_embed: Array  # [Dv]
    pos_embed: Array  # [num_patches + 1, Dv]
    pre_ln_w: Array  # [Dv]
    pre_ln_b: Array
    layers: VisionLayerWeights
    proj1: Array  # [Dv, D]
    proj2: Array  # [D, D]
    proj1_b: Array | None = None  # [D]
    proj2_b: Array | None = None


_HF_VISION_LAYER = {
    "layer_norm1.weight": "ln1_w",
    "layer_norm1.bias": "ln1_b",
    "layer_norm2.weight": "ln2_w",
    "layer_norm2.bias": "ln2_b",
    "self_attn.q_proj.weight": "wq",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.v_proj.bias": "bv",
    "self_attn.out_proj.weight": "wo",
    "self_attn.out_proj.bias": "bo",
    "mlp.fc1.weight": "fc1",
    "mlp.fc1.bias": "fc1_b",
    "mlp.fc2.weight": "fc2",
    "mlp.fc2.bias": "fc2_b",
}
_HF_VISION_TOP = {
    "vision_tower.embeddings.class_embedding": "class_embed",
    "vision_tower.embeddings.position_embedding.weight": "pos_embed",
    "vision_tower.pre_layrnorm.weight": "pre_ln_w",
    "vision_tower.pre_layrnorm.bias": "pre_ln_b",
    "multi_modal_projector.linear_1.weight": "proj1",
    "multi_modal_projector.linear_1.bias": "proj1_b",
    "multi_modal_projector.linear_2.weight": "proj2",
    "multi_modal_projector.linear_2.bias": "proj2_b",
}
_PATCH = "vision_tower.embeddings.patch_embedding.weight"


def canonical_name(name: str) -> str:
    """One spelling for the tensor names the LLaVA checkpoints in circulation use.

    llava-hf checkpoints use `vision_tower.vision_model.*`, `multi_modal_projector.*`, `language_model.model.*` and
    `language_model.lm_head.weight`; transformers 5.24's save_pretrained writes `vision_tower.*` (no vision_model)
    with the same text names; its in-memory module names are `model.vision_tower.*`, `model.multi_modal_projector.*`,
    `model.language_model.*` and `lm_head.weight`. All map to `vision_tower.*`, `multi_modal_projector.*`, and the
    plain Llama names (`model.layers.*`, `lm_head.weight`) that weights.from_hf_state_dict reads.
    """
    for top in ("vision_tower.", "multi_modal_projector.", "language_model."):
        if name.startswith("model." + top):
            name = name[len("model.") :]
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model.") :]
    if name.startswith("language_model."):
        rest = name[len("language_model.") :]
        return rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return name


def vision_weights_from_state_dict(cfg: VisionConfig, get, names, dtype: str = "float32") -> VisionWeights:
    """VisionWeights from canonical HF names (canonical_name); `get(name)` returns numpy in torch layout."""
    n, dt = cfg.layers_used, jnp.dtype(dtype)
    per_layer: dict[str, list] = {v: [None] * n for v in _HF_VISION_LAYER.values()}
    flat: dict[str, np.ndarray] = {}
    for name in names:
        if name in _HF_VISION_TOP:
            a = get(name)
            flat[_HF_VISION_TOP[name]] = a.T if a.ndim == 2 and name.startswith("multi_modal") else a
        elif name == _PATCH:  # conv [Dv, 3, p, p] (no bias in CLIP) -> a matmul over flattened patches
            a = get(name)
            flat["patch_embed"] = a.reshape(a.shape[0], -1).T
        elif name.startswith("vision_tower.encoder.layers."):
            parts = name.split(".")
            i, key = int(parts[3]), ".".join(parts[4:])
            if i < n and key in _HF_VISION_LAYER:  # layers past the feature layer never run: not loaded
                a = get(name)
                per_layer[_HF_VISION_LAYER[key]][i] = a.T if a.ndim == 2 else a
    for ours, items in per_layer.items():
        missing = [i for i, a in enumerate(items) if a is None]
        if missing:
            raise ValueError(f"checkpoint is missing vision tensor {ours} for layers {missing}")
    needed = {"patch_embed", "class_embed", "pos_embed", "pre_ln_w", "pre_ln_b", "proj1", "proj2"}
    if cfg.projector_bias:
        needed |= {"proj1_b", "proj2_b"}
    if needed - set(flat):
        raise ValueError(f"checkpoint is missing vision tensors {sorted(needed - set(flat))}")
    p, dv, d = cfg.patch_size, cfg.hidden_size, cfg.text_hidden_size
    expect = {"patch_embed": (3 * p * p, dv), "pos_embed": (cfg.num_patches + 1, dv), "proj1": (dv, d), "proj2": (d, d)}
    for k, shape in expect.items():
        if tuple(flat[k].shape) != shape:
            raise ValueError(f"vision tensor {k!r} has shape {tuple(flat[k].shape)}, the config expects {shape}")
    layers = VisionLayerWeights(**{k: jnp.asarray(np.stack(v), dt) for k, v in per_layer.items()})
    top = {k: jnp.asarray(v, dt) for k, v in flat.items() if k in needed}
    return VisionWeights(layers=layers, **top)


def _open_safetensors(path: str):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    where = {}
    for f in files:
        h = safe_open(f, framework="numpy")
        for name in h.keys():
            where[canonical_name(name)] = (h, name)

    def get(name):
        h, raw = where[name]
        return np.asarray(h.get_tensor(raw), dtype=np.float32)

    return get, set(where)


def load_llava_dir(path: str, dtype: str = "float32") -> tuple[ModelConfig, W.Weights, VisionConfig, VisionWeights]:
    """The text model (ModelConfig, Weights) and the vision half from an HF LLaVA safetensors directory."""
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    vcfg = vision_config_from_hf(d)
    tcfg = text_config_from_llava(d, dtype)
    get, names = _open_safetensors(path)
    return tcfg, W.from_hf_state_dict(tcfg, get, names), vcfg, vision_weights_from_state_dict(vcfg, get, names, dtype)


# --- the tower ----------------------------------------------------------------------------------------------------

_ACTS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's activation
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # torch's default (erf) GELU
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def layer_norm(x, w, b, eps: float):
    x32 = x.astype(jnp.float32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _encoder_layer(x, w: VisionLayerWeights, cfg: VisionConfig):
    """CLIP's pre-norm block: full (bidirectional) attention over the CLS + patch tokens, then the MLP."""
    n, s, dv = x.shape
    hd = dv // cfg.num_heads
    h = layer_norm(x, w.ln1_w, w.ln1_b, cfg.layer_norm_eps)
    q, k, v = ((h @ wt + bt).reshape(n, s, cfg.num_heads, hd) for wt, bt in ((w.wq, w.bq), (w.wk, w.bk), (w.wv, w.bv)))
    scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * hd**-0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    attn = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, s, dv)
    x = x + attn @ w.wo + w.bo
    h = layer_norm(x, w.ln2_w, w.ln2_b, cfg.layer_norm_eps)
    return x + _ACTS[cfg.hidden_act](h @ w.fc1 + w.fc1_b) @ w.fc2 + w.fc2_b


def encode_images(weights: VisionWeights, cfg: VisionConfig, pixels):
    """f32[N, 3, H, W] (preprocessed) -> [N, num_image_tokens, text_hidden]: the rows an image puts in a prompt."""
    n, c, hgt, wid = pixels.shape
    p = cfg.patch_size
    if (c, hgt, wid) != (3, cfg.image_size, cfg.image_size):
        raise ValueError(
            f"pixels have shape {pixels.shape[1:]}, the tower expects (3, {cfg.image_size}, {cfg.image_size})"
        )
    dt = weights.patch_embed.dtype
    # A stride-p conv without padding is a matmul over non-overlapping patches: cut [N, 3, H, W] into
    # [N, H/p * W/p, 3*p*p] in the conv kernel's (channel, row, col) order; patches run row-major as the
    # conv output's flatten does.
    patches = pixels.astype(dt).reshape(n, c, hgt // p, p, wid // p, p).transpose(0, 2, 4, 1, 3, 5)
    x = patches.reshape(n, cfg.num_patches, c * p * p) @ weights.patch_embed
    cls = jnp.broadcast_to(weights.class_embed, (n, 1, cfg.hidden_size)).astype(dt)
    x = jnp.concatenate([cls, x], axis=1) + weights.pos_embed
    x = layer_norm(x, weights.pre_ln_w, weights.pre_ln_b, cfg.layer_norm_eps)  # = hidden_states[0]
    if cfg.layers_used:
        x, _ = jax.lax.scan(lambda h, w: (_encoder_layer(h, w, cfg), None), x, weights.layers)
    if cfg.vision_feature_select_strategy == "default":
        x = x[:, 1:]  # drop CLS
    x = x @ weights.proj1
    if weights.proj1_b is not None:
        x = x + weights.proj1_b
    x = _ACTS[cfg.projector_act](x) @ weights.proj2
    if weights.proj2_b is not None:
        x = x + weights.proj2_b
    return x


def merge_image_features(input_embeds, input_ids, image_features, image_token_index: int):
    """Put image feature rows at the image-token positions, in order: f32[T, D] with rows replaced.

    The k-th placeholder token (counting over the whole batch, left to right) takes image_features[k], which is how
    LLaVA merges (masked_scatter). A cumsum over the mask gives each placeholder its row and one gather fetches
    them, so the shapes are static and the function jits. Callers give exactly one feature row per placeholder
    (images concatenated in prompt order, features.reshape(-1, D)); extra feature rows are ignored.
    """
    if image_features.shape[0] == 0:  # no images: nothing to gather from (static, so no trace-time branch issue)
        return input_embeds
    mask = input_ids == image_token_index
    rows = jnp.clip(jnp.cumsum(mask.astype(jnp.int32)) - 1, 0, image_features.shape[0] - 1)
    return jnp.where(mask[:, None], image_features[rows].astype(input_embeds.dtype), input_embeds)


# --- preprocessing (host) -----------------------------------------------------------------------------------------


def preprocess(image, cfg: VisionConfig) -> np.ndarray:
    """CLIP's image processor: resize the shortest side to image_size (bicubic), center crop, /255, normalise.

    Accepts a PIL image or a uint8 HxWx3 array; returns f32[3, image_size, image_size]. The resize uses PIL's
    bicubic filter on uint8 pixels, as transformers' CLIPImageProcessorPil does, so the outputs agree to float
    rounding (a numpy reimplementation of PIL's fixed-point filter would differ by up to one grey level).
    """
    from PIL import Image

    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 HxWx3 array, got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        # transparent pixels become white, as transformers' convert_to_rgb composites them (not PIL's drop-alpha)
        image = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image)
    image = image.convert("RGB")
    size = cfg.image_size
    w, h = image.size
    # transformers' get_resize_output_image_size: the short side becomes `size`, the long side int(size*long/short)
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    arr = np.asarray(image.resize((new_w, new_h), resample=Image.BICUBIC))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    arr = arr[top : top + size, left : left + size]
    x = arr.astype(np.float64) * (1 / 255)
    x = (x - np.asarray(cfg.image_mean)) / np.asarray(cfg.image_std)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)
