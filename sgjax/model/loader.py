"""Weight loaders: GGUF (dequantized), HF safetensors directory, orbax checkpoint, dummy weights."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax
import numpy as np

from sgjax.model import fp8_checkpoint, gguf_meta
from sgjax.model import weights as W
from sgjax.model.checkpoint import config_from_gguf, config_from_hf_dir
from sgjax.model.config import ModelConfig
from sgjax.model.families import FAMILY
from sgjax.model.paths import ModelNotFoundError, resolve_model_path
from sgjax.model.quant import int4_from_q4_0, int4_from_q4_1, int8_from_q8_0

ORBAX_CONFIG = "sgjax_config.json"


class WeightFileError(ValueError):
    """A weight file that exists but cannot be read (truncated, corrupt, wrong format)."""


def load_model(
    model_path: str | None = None, dtype: str = "float32", host: bool = False
) -> tuple[ModelConfig, W.Weights]:
    """Config and weights from a GGUF file, an HF directory or an orbax checkpoint; None = SmolLM2. host=True: the
    GGUF and HF loaders return numpy arrays, to be placed on a mesh (orbax restores onto the default device)."""
    if _is_orbax(model_path):
        return load_orbax(model_path, dtype)
    path = resolve_model_path(model_path)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype, host)
    return load_hf_dir(path, dtype, host)


def load_config(model_path: str | None = None, dtype: str = "float32", load_format: str = "auto") -> ModelConfig:
    """The checkpoint's config alone (metadata, config.json): what the step plan is resolved from before the weights
    are read."""
    if load_format == "dummy" or (
        model_path is not None
        and os.path.isfile(os.path.join(model_path, "config.json"))
        and _model_type(model_path) == "llava"
    ):
        from sgjax.model.vision import text_config_from_llava

        if load_format == "dummy":
            if model_path is None or not os.path.isdir(model_path):
                raise ValueError(f"load_format 'dummy' needs an HF directory with config.json, got {model_path!r}")
            return config_from_hf_dir(model_path, dtype)
        with open(os.path.join(model_path, "config.json")) as f:
            return text_config_from_llava(json.load(f), dtype)
    if _is_orbax(model_path):
        with open(os.path.join(os.path.abspath(model_path), ORBAX_CONFIG)) as f:
            return _config_from_json(json.load(f)).replace(dtype=dtype)
    path = resolve_model_path(model_path)
    if path.endswith(".gguf"):
        reader = gguf_meta.open_gguf(path)
        return config_from_gguf(gguf_meta.read_metadata(path), {t.name for t in reader.tensors}, dtype)
    return config_from_hf_dir(path, dtype)


def _model_type(path: str) -> str | None:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("model_type")


def _is_orbax(path: str | None) -> bool:
    return path is not None and os.path.isfile(os.path.join(path, ORBAX_CONFIG))


# --- GGUF -----------------------------------------------------------------------------------------


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head's q/k rows; undo it so
    # the rows are in HF's rotate_half order again (only for the llama architecture).
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(
    path: str, dtype: str = "float32", host: bool = False, keep_blocks: bool = False
) -> tuple[ModelConfig, W.Weights]:
    """keep_blocks: the matrices stored as blocks our quantized formats hold exactly stay as they are, [out, in]:
    a layer's Q4_0 / Q4_1 matrices as Int4Matrix (quant.int4_from_q4_0 / _q4_1), any Q8_0 matrix (the embedding
    too) as a grouped
    Int8Matrix (quant.int8_from_q8_0); what weights.cast_matrices(.., "int4" / "int8") finishes
    (loading.load_model_cached),
    without dequantizing and quantizing them again."""
    from gguf import GGMLQuantizationType, dequantize

    reader = gguf_meta.open_gguf(path)
    meta = gguf_meta.read_metadata(path)
    names = {t.name for t in reader.tensors}
    cfg = config_from_gguf(meta, names, dtype)
    present = [leaf for leaf in W.LEAVES if leaf.present(cfg)]
    by_layer = {W.gguf_name(cfg, leaf): leaf for leaf in present if leaf.layer}  # "attn_q.weight" (under blk.{i}.)
    top = {W.gguf_name(cfg, leaf): leaf for leaf in present if not leaf.layer}
    unpermute = FAMILY[cfg.architecture].gguf_unpermute_qk
    kept_as = {
        GGMLQuantizationType.Q4_0: int4_from_q4_0,
        GGMLQuantizationType.Q4_1: int4_from_q4_1,
        GGMLQuantizationType.Q8_0: int8_from_q8_0,
    }
    per_layer: dict[str, list] = {}
    flat: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        leaf = by_layer.get(".".join(parts[2:])) if parts[0] == "blk" else top.get(t.name)
        keep = (
            kept_as.get(t.tensor_type)
            if keep_blocks
            and leaf is not None
            and leaf.name in W.QUANTIZED_LEAVES
            and (leaf.layer or t.tensor_type == GGMLQuantizationType.Q8_0)
            else None
        )  # int4 keeps the top int8
        try:
            w = keep(np.asarray(t.data)) if keep else dequantize(t.data, t.tensor_type).astype(np.float32)
        except Exception as e:
            raise WeightFileError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from e
        if parts[0] == "blk":
            layer, kind = int(parts[1]), parts[2]
            if leaf is None:
                raise WeightFileError(f"{path}: unexpected tensor {t.name!r}")
            if kind in ("attn_q", "attn_k") and unpermute:
                heads = cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads
                w = type(w)(_unpermute(w.q, heads), _unpermute(w.scale, heads)) if keep else _unpermute(w, heads)
            if leaf.transposed and not keep:  # kept blocks are [out, in], as the file
                w = w.T
            per_layer.setdefault(leaf.name, [None] * cfg.num_layers)[layer] = w
        elif leaf is not None:
            flat[leaf.name] = w.T if leaf.transposed and not keep else w
    for ours, items in per_layer.items():
        if any(x is None for x in items):
            raise WeightFileError(f"{path}: tensor {ours} is missing for some layers")
        kinds = {type(x) for x in items}
        if len(kinds) > 1:
            raise WeightFileError(f"{path}: tensor {ours} is stored in different formats across layers")
        flat[ours] = W.stack_arrays(items)
    return cfg, _assemble(cfg, flat, path, host)


def _assemble(cfg, flat, path, host=False):
    try:
        return W.assemble(cfg, flat, host)
    except ValueError as e:
        raise WeightFileError(f"{path}: {e}") from e


# --- HF safetensors directory ------------------------------------------------------------------------


def hf_quantization(path: str) -> str | None:
    """The fp8 scheme of an HF directory's checkpoint (model/fp8_checkpoint.py), None when it is not quantized;
    ValueError naming a quantization sgjax does not read."""
    with open(os.path.join(path, "config.json")) as f:
        return fp8_checkpoint.scheme(json.load(f))


def load_hf_dir(
    path: str, dtype: str = "float32", host: bool = False, keep_fp8: bool = False
) -> tuple[ModelConfig, W.Weights]:
    """An HF safetensors directory. A pre-quantized fp8 checkpoint's matrices stay Fp8Matrix [out, in] with
    keep_fp8 (what weights.cast_matrices(.., "fp8") gives, from the file's bytes), else widened (q * scale)."""
    from safetensors import safe_open

    cfg = config_from_hf_dir(path, dtype)
    quantized = hf_quantization(path) is not None
    with open(os.path.join(path, "config.json")) as f:
        block = fp8_checkpoint.block_size(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    handles, where = [], {}
    try:
        for f in files:
            h = fp8_checkpoint.RawSafetensors(f) if quantized else safe_open(f, framework="numpy")
            handles.append(h)
            for name in h.keys():
                where[name] = h
    except Exception as e:
        raise WeightFileError(f"cannot read safetensors in {path}: {type(e).__name__}: {e}") from e

    def get(name):
        try:
            a = where[name].get_tensor(name)
            scale = fp8_checkpoint.scale_name(name, where) if quantized and name.endswith(".weight") else None
            if scale is not None:
                m = fp8_checkpoint.fp8_matrix(a, where[scale].get_tensor(scale), name, block)
                return m if keep_fp8 else m.widened(np.float32)
            return np.asarray(a, dtype=np.float32)
        except Exception as e:
            raise WeightFileError(f"{path}: cannot read tensor {name!r}: {e}") from e

    try:
        return cfg, W.from_hf_state_dict(cfg, get, set(where), host)
    except WeightFileError:
        raise
    except ValueError as e:
        raise WeightFileError(f"{path}: {e}") from e


# --- orbax ------------------------------------------------------------------------------------------


def save_orbax(path: str, cfg: ModelConfig, weights: W.Weights) -> None:
    """Save the params pytree with orbax, plus our config as JSON beside it."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), weights, force=True)
    with open(os.path.join(path, ORBAX_CONFIG), "w") as f:
        json.dump(_config_to_json(cfg), f, indent=1)


def load_orbax(path: str, dtype: str | None = None) -> tuple[ModelConfig, W.Weights]:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    with open(os.path.join(path, ORBAX_CONFIG)) as f:
        cfg = _config_from_json(json.load(f))
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    abstract = jax.eval_shape(lambda: W.dummy_weights(cfg))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(os.path.join(path, "params"), abstract)
    return cfg, restored


def _config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_json(d: dict) -> ModelConfig:
    from sgjax.model.config import RopeScaling

    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["sliding_layers"] = tuple(d.get("sliding_layers", ()))  # JSON gives a list; the config must stay hashable
    return ModelConfig(**d)
