"""LoRA adapters in the forward: HF PEFT directories read as they are, and the stacked slots a step multiplies with.

An adapter adds `scaling * B @ A` to some of a layer's projections (PEFT: y = x W + scaling * (x A^T) B^T). A step
serves up to S adapters at once from fixed slots of rank R (the largest rank served; smaller ranks are zero-padded,
which adds exact zeros): per projection, A of every slot side by side [L, in, S*R] and B stacked [L, S*R, out],
the scaling folded into B. Each token row names its slot (-1: the base model), and its delta is
((h @ A) * mask) @ B, where the mask keeps only its slot's R columns: two small matmuls for the whole batch, no
gather of per-row matrices, and a row of another slot (or of none) adds exact zeros. Nothing is merged into the
base weights, so adapters of different ranks and targets share a step with the base model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model.config import ModelConfig

# PEFT's module names -> the layer's matrices (model/weights.py LayerWeights), the order a layer applies them
MODULES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
ADAPTER_FILE = "adapter_model.safetensors"


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a projection."""
    d, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
    }[module]


class AdapterError(ValueError):
    """An adapter sgjax cannot serve; the message names what."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """One LoRA adapter on the host: per targeted module, A^T [L, in, r] and scaling * B^T [L, r, out] (float32).
    Compared by identity: an adapter loaded again under the same name is another adapter (its cached prefixes too)."""

    name: str
    path: str
    rank: int
    a: dict = field(repr=False)  # PEFT module name -> [L, in, r]
    b: dict = field(repr=False)  # PEFT module name -> [L, r, out]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m in MODULES if m in self.a)


_REFUSED_CONFIG = {  # adapter_config.json keys whose non-default values change the arithmetic we do not implement
    "use_dora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None,),
    "modules_to_save": (None, []),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "use_qalora": (False, None),
}


def read_peft(path: str, cfg: ModelConfig, name: str | None = None) -> Adapter:
    """An HF PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a model of `cfg`."""
    from safetensors.numpy import load_file

    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise AdapterError(f"{path}: no adapter_config.json (an HF PEFT LoRA directory is expected)")
    with open(config_path) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {conf.get('peft_type')!r}; only LORA adapters are served")
    for key, defaults in _REFUSED_CONFIG.items():
        if key in conf and conf[key] not in defaults:
            raise AdapterError(f"{path}: {key}={conf[key]!r} is not supported")
    rank = int(conf["r"])
    alpha = float(conf.get("lora_alpha", rank))
    scaling = alpha / (rank**0.5 if conf.get("use_rslora") else rank)
    weights_path = os.path.join(path, ADAPTER_FILE)
    if not os.path.isfile(weights_path):
        raise AdapterError(f"{path}: no {ADAPTER_FILE} (adapter_model.bin is not read: save with safetensors)")
    tensors = load_file(weights_path)
    a, b, seen = {}, {}, set()
    for key, value in tensors.items():
        parts = key.split(".")
        if "lora_A" not in parts and "lora_B" not in parts:
            raise AdapterError(f"{path}: tensor {key} is not a LoRA A or B matrix (only those are served)")
        side = "lora_A" if "lora_A" in parts else "lora_B"
        module = parts[parts.index(side) - 1]
        if module not in MODULES or "layers" not in parts:
            raise AdapterError(f"{path}: {key} targets {module!r}; LoRA is served on {sorted(MODULES)} of the layers")
        layer = int(parts[parts.index("layers") + 1])
        if not 0 <= layer < cfg.num_layers:
            raise AdapterError(f"{path}: {key} is for layer {layer}; the model has {cfg.num_layers}")
        fan_in, fan_out = module_shape(cfg, module)
        want = (rank, fan_in) if side == "lora_A" else (fan_out, rank)
        if tuple(value.shape) != want:
            raise AdapterError(f"{path}: {key} is {list(value.shape)}, expected {list(want)} for this model")
        store, (rows, cols) = (a, (fan_in, rank)) if side == "lora_A" else (b, (rank, fan_out))
        store.setdefault(module, np.zeros((cfg.num_layers, rows, cols), np.float32))
        t = value.astype(np.float32).T
        store[module][layer] = t if side == "lora_A" else t * np.float32(scaling)
        seen.add((module, layer, side))
    if not a:
        raise AdapterError(f"{path}: no LoRA matrices in {ADAPTER_FILE}")
    for module in a:
        missing = [i for i in range(cfg.num_layers) for s in ("lora_A", "lora_B") if (module, i, s) not in seen]
        if missing:  # PEFT writes A and B for every layer a module targets (layers_to_transform is refused)
            raise AdapterError(f"{path}: {module} lacks the matrices of layers {sorted(set(missing))[:4]}")
    return Adapter(name or os.path.basename(os.path.normpath(path)), path, rank, a, b)


@jax.tree_util.register_dataclass
@dataclass
class LoraStacks:
    """Every slot's adapters, as a step reads them: per targeted layer matrix (wq, wo, ...), A [L, in, S*R] and
    B [L, S*R, out]; `rank` R (static)."""

    a: dict
    b: dict
    rank: int = field(metadata=dict(static=True))


def empty_stacks(cfg: ModelConfig, modules, slots: int, rank: int, dtype) -> LoraStacks:
    """Zeros for `slots` slots of rank `rank` over the PEFT `modules`."""
    a, b = {}, {}
    for m in modules:
        fan_in, fan_out = module_shape(cfg, m)
        a[MODULES[m]] = jnp.zeros((cfg.num_layers, fan_in, slots * rank), dtype)
        b[MODULES[m]] = jnp.zeros((cfg.num_layers, slots * rank, fan_out), dtype)
    return LoraStacks(a, b, rank)


def slot_values(stacks: LoraStacks, adapter: Adapter | None) -> tuple[dict, dict]:
    """One slot's A [L, in, R] and B [L, R, out] per stacked matrix: the adapter's, zero-padded to R (zeros for the
    modules it does not target, and everywhere for None)."""
    r = stacks.rank
    a, b = {}, {}
    inverse = {v: k for k, v in MODULES.items()}
    for name, stacked in stacks.a.items():
        layers, fan_in, _ = stacked.shape
        fan_out = stacks.b[name].shape[-1]
        a[name] = np.zeros((layers, fan_in, r), np.float32)
        b[name] = np.zeros((layers, r, fan_out), np.float32)
        module = inverse[name]
        if adapter is not None and module in adapter.a:
            a[name][:, :, : adapter.rank] = adapter.a[module]
            b[name][:, : adapter.rank, :] = adapter.b[module]
    return a, b


@jax.jit
def write_slot(stacks: LoraStacks, slot, a: dict, b: dict) -> LoraStacks:
    """`stacks` with slot `slot` holding A / B (slot_values). A new copy: a step in flight keeps reading the old."""
    r = stacks.rank
    new_a = {n: jax.lax.dynamic_update_slice_in_dim(s, a[n].astype(s.dtype), slot * r, 2) for n, s in stacks.a.items()}
    new_b = {n: jax.lax.dynamic_update_slice_in_dim(s, b[n].astype(s.dtype), slot * r, 1) for n, s in stacks.b.items()}
    return LoraStacks(new_a, new_b, r)


def row_mask(slots, stacks: LoraStacks, dtype):
    """[T, S*R]: 1 on the columns of each token row's slot, 0 elsewhere (and everywhere for slot -1)."""
    width = next(iter(stacks.a.values())).shape[-1]
    owner = jnp.arange(width, dtype=jnp.int32) // stacks.rank
    return (owner[None, :] == slots[:, None]).astype(dtype)


def layer(stacks: LoraStacks, index) -> tuple[dict, dict]:
    """One layer's (A, B) per matrix (index static, or traced in a scan)."""
    return {n: s[index] for n, s in stacks.a.items()}, {n: s[index] for n, s in stacks.b.items()}


def add(lora, h, names: tuple[str, ...], outs):
    """outs[i] + the rows' adapter deltas for matrix names[i] (unchanged where no adapter targets it); lora is
    ((A, B) of this layer, row_mask) or None."""
    if lora is None:
        return outs
    (a, b), mask = lora
    out = []
    for name, o in zip(names, outs):
        if name in a:
            with jax.named_scope("lora"):
                xa = jnp.dot(h.astype(a[name].dtype), a[name], preferred_element_type=jnp.float32)
                xa = (xa * mask).astype(b[name].dtype)
                o = o + jnp.dot(xa, b[name], preferred_element_type=jnp.float32).astype(o.dtype)
        out.append(o)
    return tuple(out)
