"""The parameter pytree and its one declaration (`LEAVES`): shapes, logical axes, init, checkpoint names.

Per-layer weights are stacked on a leading layer axis as loaded; the step plan (engine/plan.py) keeps them stacked
where the forward scans them (CPU: compile time flat in depth) and splits them into a tuple of per-layer weights
where it unrolls (accelerators: scanning copied each layer's weights on the GPU,
docs/journal/architecture-measured.md). Float
matrices are stored (in, out) so the forward is `x @ w`; quantized ones (model/quant.py) and the CPU's packed panels
(model/native.py) are (out, in). Every leaf has logical axis names so that a sharding rule table can place them on a
mesh without touching the model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sgjax.model.config import ModelConfig
from sgjax.model.quant import Fp8Matrix, Int4Matrix, Int8Matrix, is_quantized, quantize, quantize_fp8, quantize_int4

Array = Any


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    """The transformer blocks: every array with a leading [num_layers] axis (stacked), or one block's arrays (an
    element of the per-layer tuple an accelerator's forward unrolls)."""

    attn_norm: Array  # [L, D]
    wq: Array  # [L, D, Hq*hd]
    wk: Array  # [L, D, Hkv*hd]
    wv: Array  # [L, D, Hkv*hd]
    wo: Array  # [L, Hq*hd, D]
    mlp_norm: Array  # [L, D]
    w_gate: Array | None = None  # [L, D, F]; None in a mixture of experts
    w_up: Array | None = None  # [L, D, F]
    w_down: Array | None = None  # [L, F, D]
    bq: Array | None = None  # [L, Hq*hd] (Qwen2)
    bk: Array | None = None
    bv: Array | None = None
    q_norm: Array | None = None  # [L, hd] (Qwen3, Gemma 3), shared by the heads
    k_norm: Array | None = None
    post_attn_norm: Array | None = None  # [L, D] (Gemma 2/3)
    post_mlp_norm: Array | None = None
    router: Array | None = None  # [L, D, E] (mixtures of experts, model/moe.py)
    we_gate: Array | None = None  # [L, E, D, Fe]
    we_up: Array | None = None  # [L, E, D, Fe]
    we_down: Array | None = None  # [L, E, Fe, D]


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    embed: Array  # [V, D]
    layers: LayerWeights | tuple[LayerWeights, ...]  # stacked (scanned) or per layer (unrolled)
    final_norm: Array  # [D]
    lm_head: Array | None = None  # [D, V]; None when tied to embed


@dataclass(frozen=True)
class Leaf:
    """One parameter, declared once: its shape (per layer for a layer leaf: the stacked array adds [L] in front),
    logical axes (the sharding rules' names), initialisation, and its names in HF and GGUF checkpoints (a layer
    leaf's under `model.layers.{i}.` and `blk.{i}.`). `transposed`: stored (in, out), checkpoints hold (out, in)."""

    name: str
    shape: Callable[[ModelConfig], tuple[int, ...]]
    axes: tuple[str, ...]
    hf: str
    gguf: str
    layer: bool = True
    transposed: bool = False
    init: str = "normal"  # "ones": norm scales
    present: Callable[[ModelConfig], bool] = lambda cfg: True


def _matrix(name, rows, cols, axes, hf, gguf):
    return Leaf(name, lambda c: (rows(c), cols(c)), axes, hf, gguf, transposed=True)


_D, _Q, _KV = (lambda c: c.hidden_size), (lambda c: c.q_size), (lambda c: c.kv_size)
_F, _V = (lambda c: c.intermediate_size), (lambda c: c.vocab_size)
_DENSE, _MOE = (lambda c: not c.is_moe), (lambda c: c.is_moe)


def _expert(name, rows, cols, axes, hf):
    """An expert matrix stacked over the experts ([E, rows, cols]); `hf` names one expert's tensor ({e})."""
    return Leaf(
        name, lambda c: (c.num_experts, rows(c), cols(c)), ("expert", *axes), hf, "", transposed=True, present=_MOE
    )


_FE = lambda c: c.moe_intermediate_size  # noqa: E731
# In this order: dummy_weights draws one key per leaf in it.
LEAVES: tuple[Leaf, ...] = (
    Leaf(
        "embed",
        lambda c: (c.vocab_size, c.hidden_size),
        ("vocab", "embed"),
        "model.embed_tokens.weight",
        "token_embd.weight",
        layer=False,
    ),
    Leaf(
        "final_norm",
        lambda c: (c.hidden_size,),
        ("embed",),
        "model.norm.weight",
        "output_norm.weight",
        layer=False,
        init="ones",
    ),
    Leaf(
        "attn_norm", lambda c: (c.hidden_size,), ("embed",), "input_layernorm.weight", "attn_norm.weight", init="ones"
    ),
    Leaf(
        "mlp_norm",
        lambda c: (c.hidden_size,),
        ("embed",),
        "post_attention_layernorm.weight",
        "ffn_norm.weight",
        init="ones",
    ),
    _matrix("wq", _D, _Q, ("embed", "q_heads"), "self_attn.q_proj.weight", "attn_q.weight"),
    _matrix("wk", _D, _KV, ("embed", "kv_heads"), "self_attn.k_proj.weight", "attn_k.weight"),
    _matrix("wv", _D, _KV, ("embed", "kv_heads"), "self_attn.v_proj.weight", "attn_v.weight"),
    _matrix("wo", _Q, _D, ("q_heads", "embed"), "self_attn.o_proj.weight", "attn_output.weight"),
    dataclasses.replace(
        _matrix("w_gate", _D, _F, ("embed", "mlp"), "mlp.gate_proj.weight", "ffn_gate.weight"), present=_DENSE
    ),
    dataclasses.replace(
        _matrix("w_up", _D, _F, ("embed", "mlp"), "mlp.up_proj.weight", "ffn_up.weight"), present=_DENSE
    ),
    dataclasses.replace(
        _matrix("w_down", _F, _D, ("mlp", "embed"), "mlp.down_proj.weight", "ffn_down.weight"), present=_DENSE
    ),
    Leaf(
        "bq", lambda c: (c.q_size,), ("q_heads",), "self_attn.q_proj.bias", "attn_q.bias", present=lambda c: c.qkv_bias
    ),
    Leaf(
        "bk",
        lambda c: (c.kv_size,),
        ("kv_heads",),
        "self_attn.k_proj.bias",
        "attn_k.bias",
        present=lambda c: c.qkv_bias,
    ),
    Leaf(
        "bv",
        lambda c: (c.kv_size,),
        ("kv_heads",),
        "self_attn.v_proj.bias",
        "attn_v.bias",
        present=lambda c: c.qkv_bias,
    ),
    dataclasses.replace(
        _matrix("lm_head", _D, _V, ("embed", "vocab"), "lm_head.weight", "output.weight"),
        layer=False,
        present=lambda c: not c.tie_word_embeddings,
    ),
    # per head (Qwen3, Gemma 3) or over the whole projection (OLMoE); replicated either way
    Leaf(
        "q_norm",
        lambda c: (c.head_dim if c.qk_norm_per_head else c.q_size,),
        ("head_dim",),
        "self_attn.q_norm.weight",
        "attn_q_norm.weight",
        init="ones",
        present=lambda c: c.qk_norm,
    ),
    Leaf(
        "k_norm",
        lambda c: (c.head_dim if c.qk_norm_per_head else c.kv_size,),
        ("head_dim",),
        "self_attn.k_norm.weight",
        "attn_k_norm.weight",
        init="ones",
        present=lambda c: c.qk_norm,
    ),
    Leaf(
        "post_attn_norm",
        lambda c: (c.hidden_size,),
        ("embed",),
        "post_attention_norm.weight",
        "post_attention_norm.weight",
        init="ones",
        present=lambda c: c.sandwich_norms,
    ),
    Leaf(
        "post_mlp_norm",
        lambda c: (c.hidden_size,),
        ("embed",),
        "post_mlp_norm.weight",
        "post_ffw_norm.weight",
        init="ones",
        present=lambda c: c.sandwich_norms,
    ),
    dataclasses.replace(
        _matrix("router", _D, lambda c: c.num_experts, ("embed", "router"), "mlp.gate.weight", ""), present=_MOE
    ),
    _expert("we_gate", _D, _FE, ("embed", "expert_mlp"), "mlp.experts.{e}.gate_proj.weight"),
    _expert("we_up", _D, _FE, ("embed", "expert_mlp"), "mlp.experts.{e}.up_proj.weight"),
    _expert("we_down", _FE, _D, ("expert_mlp", "embed"), "mlp.experts.{e}.down_proj.weight"),
)
LEAF = {leaf.name: leaf for leaf in LEAVES}
# The matrices a dot reads (the plan's weight_dtype applies to these): every transposed leaf and the embedding (the tied
# LM head), not the router, whose float32 logits pick the experts.
MATMUL_LEAVES = frozenset({"embed"} | {leaf.name for leaf in LEAVES if leaf.transposed and leaf.name != "router"})


# The dense matrices: every transposed leaf but the router and the experts (ragged_dot and the grouped-matmul kernel
# take [E, in, out]). What --weight-dtype int8 / int4 quantizes (with the embedding, the tied head) and what the CPU's
# native kernel multiplies (model/native.py).
DENSE_LEAVES = frozenset(
    leaf.name for leaf in LEAVES if leaf.transposed and leaf.name != "router" and "expert" not in leaf.axes
)
QUANTIZED_LEAVES = DENSE_LEAVES | {"embed"}
# int4 keeps these in int8: in 4 bits the tied head lost SmolLM2's greedy answers (docs/engine.md), and llama.cpp's
# Q4 files keep them wider too.
TOP_MATRICES = frozenset({"embed", "lm_head"})
QUANTIZED_DTYPES = ("int8", "int4", "fp8")


def matrices_dtype(weights: Weights) -> str:
    """The matrices' dtype: float32 | bfloat16 | int8 | int4 (of the first layer's wq)."""
    layers = weights.layers
    wq = layers[0].wq if isinstance(layers, (tuple, list)) else layers.wq
    if isinstance(wq, Int4Matrix):
        return "int4"
    if isinstance(wq, Int8Matrix):
        return "int8"
    if isinstance(wq, Fp8Matrix):
        return "fp8"
    return getattr(wq, "kind", None) or jnp.dtype(wq.dtype).name


def cast_matrices(weights: Weights, weight_dtype: str) -> Weights:
    """weights with their matrices in weight_dtype: float ones cast as they are ([in, out]), int8 / int4 quantized
    along each output row ([out, in], model/quant.py; int4 keeps TOP_MATRICES in int8). Matrices already quantized
    (a GGUF's kept blocks) stay. numpy leaves stay numpy; stacked and unrolled layers alike."""
    current = matrices_dtype(weights)
    if current == weight_dtype and current not in QUANTIZED_DTYPES:
        return weights
    if current in QUANTIZED_DTYPES and current != weight_dtype:
        raise ValueError(f"{current} matrices cannot be cast to {weight_dtype}: load the model's weights")

    def quantized(name, a):
        rows = (
            a if name == "embed" else (np.swapaxes(a, -1, -2) if isinstance(a, np.ndarray) else jnp.swapaxes(a, -1, -2))
        )
        if weight_dtype == "fp8":
            return quantize_fp8(rows)
        return (quantize_int4 if weight_dtype == "int4" and name not in TOP_MATRICES else quantize)(rows)

    def cast(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            a = getattr(obj, f.name)
            if a is None or is_quantized(a):
                continue
            if weight_dtype == "fp8":  # the layers' projections, as SGLang's fp8 does; the rest as loaded
                if f.name in DENSE_LEAVES and f.name not in TOP_MATRICES:
                    changes[f.name] = quantized(f.name, a)
            elif weight_dtype in ("int8", "int4") and f.name in QUANTIZED_LEAVES:
                changes[f.name] = quantized(f.name, a)
            elif weight_dtype not in QUANTIZED_DTYPES and f.name in MATMUL_LEAVES:
                changes[f.name] = a.astype(jnp.dtype(weight_dtype))
        return dataclasses.replace(obj, **changes)

    layers = tuple(map(cast, weights.layers)) if isinstance(weights.layers, (tuple, list)) else cast(weights.layers)
    return dataclasses.replace(cast(weights), layers=layers)


def hf_name(cfg: ModelConfig, leaf: Leaf) -> str:
    """The leaf's name in the family's HF checkpoints (a layer leaf's under model.layers.{i}.)."""
    from sgjax.model.families import FAMILY

    return FAMILY[cfg.architecture].hf_names.get(leaf.name, leaf.hf)


def gguf_name(cfg: ModelConfig, leaf: Leaf) -> str:
    from sgjax.model.families import FAMILY

    return FAMILY[cfg.architecture].gguf_names.get(leaf.name, leaf.gguf)


LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    leaf.name: (("layers",) if leaf.layer else ()) + leaf.axes for leaf in LEAVES
}


def quantized_axes(name: str, a, axes: tuple[str, ...]):
    """An Fp8Matrix's axes: q [..., out, in] as its float matrix's axes swapped, the scale [..., out] its output
    axis (a block-scaled one's [..., out, in / bk] both), so a matrix sharded on either axis keeps each row's scale
    beside the row. Other quantized formats (int8,
    int4: blocks along the input axis) are not sharded."""
    if not isinstance(a, Fp8Matrix) or not LEAF[name].transposed:
        raise ValueError(f"{name}: {type(a).__name__} matrices cannot be sharded (tensor parallelism shards fp8 only)")
    lead, (inp, out) = axes[:-2], axes[-2:]
    return Fp8Matrix(lead + (out, inp), lead + ((out, inp) if a.grouped else (out,)))


def logical_axes(weights: Weights) -> Weights:
    """A Weights-shaped pytree of logical axis-name tuples (None where the leaf is None)."""

    def axes_of(obj, drop_layer_axis=False):
        out = {}
        for f in dataclasses.fields(obj):
            if f.name == "layers":
                continue
            a, axes = getattr(obj, f.name), LOGICAL_AXES[f.name][drop_layer_axis:]
            out[f.name] = None if a is None else quantized_axes(f.name, a, axes) if is_quantized(a) else axes
        return out

    if isinstance(weights.layers, (tuple, list)):
        layers = tuple(LayerWeights(**axes_of(w, True)) for w in weights.layers)
    else:
        layers = LayerWeights(**axes_of(weights.layers))
    return Weights(layers=layers, **axes_of(weights))


def stack_layers(weights: Weights) -> Weights:
    """Stacked weights (one array per leaf, layers first) from per-layer ones; stacked ones as they are."""
    if not isinstance(weights.layers, (tuple, list)):
        return weights
    return dataclasses.replace(weights, layers=jax.tree.map(lambda *a: jnp.stack(a), *weights.layers))


def unstack_layers(weights: Weights) -> Weights:
    """Per-layer weights for an unrolled forward (the GPU layout: see llama.forward)."""
    if isinstance(weights.layers, (tuple, list)):
        return weights
    n = weights.layers.wq.shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], weights.layers) for i in range(n))
    return dataclasses.replace(weights, layers=layers)


def shardings(weights: Weights, mesh: jax.sharding.Mesh, rules: Mapping[str, str | None]) -> Weights:
    """NamedShardings from logical axes and a rule table, e.g. {"q_heads": "tensor", "mlp": "tensor"}."""
    P = jax.sharding.PartitionSpec
    axes = logical_axes(weights)
    return jax.tree.map(
        lambda names: jax.sharding.NamedSharding(mesh, P(*(rules.get(n) for n in names))), axes, is_leaf=_is_axes
    )


def _is_axes(x) -> bool:
    """A leaf's axis names (a tuple of str), not the unrolled layers' tuple of LayerWeights."""
    return isinstance(x, tuple) and all(isinstance(n, str) for n in x)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every present leaf's full shape (layer leaves stacked on [L])."""
    return {
        leaf.name: ((cfg.num_layers,) if leaf.layer else ()) + leaf.shape(cfg) for leaf in LEAVES if leaf.present(cfg)
    }


def assemble(cfg: ModelConfig, arrays: Mapping[str, Any], host: bool = False) -> Weights:
    """Weights from a flat dict of our names, checking every shape against the config. host=True keeps them numpy
    arrays (of the config's dtype) for placement on a mesh (engine/mesh.py), so no device gets the whole model."""
    expected = shapes(cfg)
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise ValueError(f"checkpoint is missing tensors for {missing}")
    out = {}
    for name, shape in expected.items():
        a = arrays[name]
        if is_quantized(a):  # kept as the file's blocks (loader.load_gguf): [out, in]
            nk = shape[:-2] + shape[:-3:-1] if LEAF[name].transposed else shape
            if tuple(a.shape) != nk:
                raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)} [out, in], the config expects {nk}")
            put = np.asarray if host else jnp.asarray
            out[name] = type(a)(put(a.q), put(a.scale))
            continue
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, the config expects {shape}")
        dtype = jnp.dtype(cfg.dtype)
        out[name] = np.asarray(a, dtype=dtype) if host else jnp.asarray(a, dtype=dtype)
    layer_names = {f.name for f in dataclasses.fields(LayerWeights)}
    layers = LayerWeights(**{k: v for k, v in out.items() if k in layer_names})
    return Weights(layers=layers, **{k: v for k, v in out.items() if k not in layer_names})


def _draw(key, names, shape_of, dtype) -> dict:
    """Random leaves: ones for norm scales, else normal / sqrt(fan_in), drawn in the weights' dtype (a float32 draw
    of Mixtral-8x7B's stacked experts is a 60 GB temporary)."""
    out = {}
    for k, name in zip(jax.random.split(key, len(names)), names):
        shape = shape_of(name)
        if LEAF[name].init == "ones":
            out[name] = jnp.ones(shape, dtype)
        else:
            fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else shape[-1]
            out[name] = jax.random.normal(k, shape, dtype) * jnp.asarray(fan_in**-0.5, dtype)
    return out


def dummy_layer_weights(cfg: ModelConfig, seed: int = 0) -> Weights:
    """Random weights in the unrolled layout (a tuple of per-layer weights), made one layer at a time: a large
    model (Mixtral-8x7B's 93 GB in bf16) is never held twice, stacked and sliced (benchmarks on one device)."""
    full = shapes(cfg)
    draw = functools.partial(
        _draw, shape_of=lambda n: full[n][1:] if LEAF[n].layer else full[n], dtype=jnp.dtype(cfg.dtype)
    )
    one_layer = jax.jit(functools.partial(draw, names=tuple(n for n in full if LEAF[n].layer)))
    top = jax.jit(functools.partial(draw, names=tuple(n for n in full if not LEAF[n].layer)))
    key = jax.random.PRNGKey(seed)
    layers = tuple(LayerWeights(**one_layer(jax.random.fold_in(key, i))) for i in range(cfg.num_layers))
    return Weights(layers=layers, **top(jax.random.fold_in(key, cfg.num_layers)))


def dummy_weights(cfg: ModelConfig, seed: int = 0, shardings: Mapping[str, Any] | None = None) -> Weights:
    """Random weights of the config's real shapes, generated on device (for performance runs). `shardings` (leaf
    name -> Sharding) makes each leaf born sharded: jax's partitionable threefry gives the same values either way."""
    expected = shapes(cfg)
    init = functools.partial(_draw, names=tuple(expected), shape_of=expected.__getitem__, dtype=jnp.dtype(cfg.dtype))
    arrays = jax.jit(init, out_shardings=None if shardings is None else dict(shardings))(jax.random.PRNGKey(seed))
    layer_names = {f.name for f in dataclasses.fields(LayerWeights)}
    layers = LayerWeights(**{k: v for k, v in arrays.items() if k in layer_names})
    return Weights(layers=layers, **{k: v for k, v in arrays.items() if k not in layer_names})


def _plus_one(cfg: ModelConfig, leaf: Leaf) -> float:
    """What HF's checkpoint adds to this leaf to give sgjax's value: 1 for Gemma's norm scales, else 0."""
    from sgjax.model.families import FAMILY

    return 1.0 if FAMILY[cfg.architecture].norm_plus_one and leaf.init == "ones" else 0.0


def from_hf_state_dict(cfg: ModelConfig, get: Any, names: set[str], host: bool = False) -> Weights:
    """Weights from HF tensor names; `get(name)` returns a numpy array in torch layout (out, in)."""
    from sgjax.model.families import FAMILY

    fused = FAMILY[cfg.architecture].hf_fused
    present = [leaf for leaf in LEAVES if leaf.present(cfg)]
    layer_leaf = {hf_name(cfg, leaf): leaf for leaf in present if leaf.layer and "{e}" not in hf_name(cfg, leaf)}
    # one tensor per expert (the checkpoints' layout), stacked on the expert axis here
    expert_leaf = {
        hf_name(cfg, leaf).format(e=e): (leaf, e)
        for leaf in present
        if "{e}" in hf_name(cfg, leaf)
        for e in range(cfg.num_experts)
    }
    per_expert = {
        leaf.name: [[None] * cfg.num_experts for _ in range(cfg.num_layers)] for leaf, _ in expert_leaf.values()
    }
    top_leaf = {hf_name(cfg, leaf): leaf for leaf in present if not leaf.layer}
    per_layer: dict[str, list] = {leaf.name: [None] * cfg.num_layers for leaf in present if leaf.layer}
    flat: dict[str, Any] = {}

    def ours(leaf, a):
        if is_quantized(a):  # a pre-quantized checkpoint's matrix: kept [out, in], as assemble takes it
            return a
        a = a + _plus_one(cfg, leaf) if _plus_one(cfg, leaf) else a
        return a.T if leaf.transposed else a

    for name in names:
        if name in top_leaf:
            flat[top_leaf[name].name] = ours(top_leaf[name], get(name))
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 4:
            continue  # e.g. rotary inv_freq buffers
        rest, i = ".".join(parts[3:]), int(parts[2])
        if rest not in layer_leaf and rest not in fused and rest not in expert_leaf:
            continue
        if i >= cfg.num_layers:
            raise ValueError(f"tensor {name!r} is for layer {i}, the config has {cfg.num_layers} layers")
        if rest in expert_leaf:
            leaf, e = expert_leaf[rest]
            per_expert[leaf.name][i][e] = ours(leaf, get(name))
            continue
        if rest in fused:  # stacked on the output axis, in the order the family lists them
            a, start = get(name), 0
            for leaf in (LEAF[n] for n in fused[rest]):
                rows = leaf.shape(cfg)[1]
                per_layer[leaf.name][i] = ours(leaf, _rows(a, start, start + rows))
                start += rows
            if start != a.shape[0]:
                raise ValueError(f"tensor {name!r} has {a.shape[0]} rows, its parts {list(fused[rest])} {start}")
            continue
        per_layer[layer_leaf[rest].name][i] = ours(layer_leaf[rest], get(name))
    for leaf_name, layers in per_expert.items():
        for i, items in enumerate(layers):
            missing = [e for e, x in enumerate(items) if x is None]
            if len(missing) < len(items):
                if missing:
                    raise ValueError(f"checkpoint has {leaf_name} of layer {i} for some experts but not for {missing}")
                per_layer[leaf_name][i] = stack_arrays(items)
    for leaf_name, items in per_layer.items():
        got = [x is not None for x in items]
        if all(got):
            if len({is_quantized(x) for x in items}) > 1:
                raise ValueError(f"checkpoint has {leaf_name} quantized in some layers and not in others")
            flat[leaf_name] = stack_arrays(items)
        elif any(got):
            missing = [i for i, p in enumerate(got) if not p]
            raise ValueError(f"checkpoint has {leaf_name} for some layers but not for layers {missing}")
    return assemble(cfg, flat, host)


def _rows(a, start: int, stop: int):
    return type(a)(a.q[start:stop], a.scale[start:stop]) if is_quantized(a) else a[start:stop]


def stack_arrays(items: list):
    """numpy arrays, or quantized matrices of one kind, stacked on a new leading axis (layers, experts)."""
    if is_quantized(items[0]):
        return type(items[0])(np.stack([x.q for x in items]), np.stack([x.scale for x in items]))
    return np.stack(items)


def to_hf_state_dict(cfg: ModelConfig, weights: Weights, convert: Any = np.asarray) -> dict[str, Any]:
    """HF tensor names -> convert(tensor in torch layout (out, in)): the inverse of from_hf_state_dict (benchmarks
    give HF transformers the same dummy weights). A tied head has no lm_head entry."""
    from sgjax.model.families import FAMILY

    fused = FAMILY[cfg.architecture].hf_fused
    in_fused = {n: key for key, parts in fused.items() for n in parts}
    out: dict[str, Any] = {}
    stacked = not isinstance(weights.layers, (tuple, list))

    def hf(leaf, a):
        a = np.asarray(a, np.float32) - _plus_one(cfg, leaf) if _plus_one(cfg, leaf) else a
        return a.T if leaf.transposed else a

    for leaf in LEAVES:
        if not leaf.present(cfg):
            continue
        if not leaf.layer:
            out[hf_name(cfg, leaf)] = convert(hf(leaf, getattr(weights, leaf.name)))
            continue
        if leaf.name in in_fused:
            continue
        for i in range(cfg.num_layers):
            a = getattr(weights.layers, leaf.name)[i] if stacked else getattr(weights.layers[i], leaf.name)
            if "{e}" in hf_name(cfg, leaf):
                for e in range(cfg.num_experts):
                    out[f"model.layers.{i}.{hf_name(cfg, leaf).format(e=e)}"] = convert(hf(leaf, a[e]))
                continue
            out[f"model.layers.{i}.{hf_name(cfg, leaf)}"] = convert(hf(leaf, a))
    for key, parts in fused.items():
        for i in range(cfg.num_layers):
            layer = jax.tree.map(lambda x: x[i], weights.layers) if stacked else weights.layers[i]
            out[f"model.layers.{i}.{key}"] = convert(np.concatenate([np.asarray(getattr(layer, n)).T for n in parts]))
    return out
