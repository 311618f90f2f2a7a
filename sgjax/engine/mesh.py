"""Single-host tensor parallelism: the device mesh, where every weight and the KV pool live on it, and attention
under shard_map (docs/model.md, "Tensor parallelism").

The mesh is (data=1, tensor=N) over the first N devices. Weights are placed by their logical axes (model/weights.py
LEAVES) and `RULES`: the column-parallel matmuls (wq, wk, wv, w_gate, w_up) split their output heads / MLP columns,
the row-parallel ones (wo, w_down) their input, so each layer needs one all-reduce after wo and one after w_down
(GSPMD inserts them; the residual stream stays replicated). The embedding and the lm_head are replicated: the sampler
needs full-vocabulary logits, and at TP=2 on CPU a vocab-sharded head (sharded logits, then a gather) was no faster
(docs/engine.md). Attention runs under shard_map over the head axis, so a kernel (ref or Pallas) sees its local q
heads, its local KV heads and its slice of the pool; the batch metadata is replicated and the host (scheduler,
radix cache, allocator, one page table) is unchanged.

When tp > num_kv_heads (tp % num_kv_heads == 0), each KV head is copied to tp / num_kv_heads devices, as vLLM and
SGLang do: wk / wv (and bk / bv) are expanded at load time to tp heads, and the model runs with num_kv_heads = tp,
so every device holds exactly the one KV head its q heads read (`tp_config`, `expand_kv`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgjax.model import weights as W
from sgjax.model.config import ModelConfig
from sgjax.model.moe import experts

AXES = ("data", "tensor")
try:  # GSPMD ("auto") axes, spelled out where jax has axis types: the placement and shard_map rely on them
    from jax.sharding import AxisType

    _AUTO_AXES = dict(axis_types=(AxisType.Auto,) * len(AXES))
except ImportError:
    _AUTO_AXES = {}
# logical axis -> mesh axis; axes not named here are replicated ("vocab", "embed", "layers", "router")
RULES = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "expert_mlp": "tensor"}
VOCAB_RULES = {**RULES, "vocab": "tensor"}  # the vocab-sharded alternative (scripts/perf/bench_tp.py --shard-vocab)
# expert parallelism: whole experts per device instead of every expert's columns (the step plan's expert_parallel)
EP_CHANGES = {"expert": "tensor", "expert_mlp": None}
KV_LEAVES = ("wk", "wv", "bk", "bv")
POOL_SPEC = P(None, None, None, "tensor", None)  # [L, pages, page_size, 2*Hkv, D]: K/V interleaved by head
HEADS_SPEC = P(None, "tensor", None)  # q, k, v and the attention output: [T, H, D]


def make_mesh(tp_size: int, devices: Sequence[Any] | None = None) -> Mesh:
    """(data=1, tensor=tp_size) over the first tp_size devices. `devices` defaults to jax.devices(), which spans
    every process's devices once jax.distributed is initialised (multi-host later)."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if tp_size > len(devices):
        raise ValueError(
            f"tp_size={tp_size} needs {tp_size} devices, but only {len(devices)} "
            f"{devices[0].platform} device(s) are visible"
        )
    return Mesh(np.asarray(devices[:tp_size]).reshape(1, tp_size), AXES, **_AUTO_AXES)


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["tensor"]


def check_model(cfg: ModelConfig, tp: int, ep: int = 1) -> None:
    """One-line errors naming tp_size / ep_size for models that cannot split that way."""
    if cfg.num_heads % tp:
        raise ValueError(f"tp_size={tp} must divide the model's {cfg.num_heads} attention heads")
    kv = cfg.num_kv_heads
    if (kv % tp) if tp <= kv else (tp % kv):
        raise ValueError(f"tp_size={tp} and the model's {kv} KV heads: one must divide the other")
    if ep not in (1, tp):
        raise ValueError(f"ep_size={ep} must be 1 or tp_size={tp}: the experts split over the tensor-parallel devices")
    if ep > 1 and not cfg.is_moe:
        raise ValueError(f"ep_size={ep} needs a mixture-of-experts model ({cfg.architecture} has no experts)")
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(f"ep_size={ep} must divide the model's {cfg.num_experts} experts")
    if ep == 1 and cfg.mlp_width % tp:
        raise ValueError(f"tp_size={tp} must divide the model's MLP width {cfg.mlp_width}")


def tp_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config the sharded model runs with: KV heads replicated up to tp when there are fewer."""
    return cfg.replace(num_kv_heads=tp) if tp > cfg.num_kv_heads else cfg


def expand_kv(a, cfg: ModelConfig, tp: int):
    """A wk / wv ([.., D, Hkv*hd]) or bk / bv ([.., Hkv*hd]) leaf with each KV head repeated tp / Hkv times in
    place (head h -> heads h*r .. h*r + r-1), so q head j still reads the copy of KV head j // (Hq / Hkv)."""
    r = tp // cfg.num_kv_heads
    if r <= 1:
        return a
    xp = jnp if isinstance(a, jax.Array) else np
    lead = a.shape[:-1]
    heads = a.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return xp.repeat(heads, r, axis=-2).reshape(*lead, cfg.num_kv_heads * r * cfg.head_dim)


def rules(shard_vocab: bool = False, expert_parallel: bool = False) -> dict:
    return {**(VOCAB_RULES if shard_vocab else RULES), **(EP_CHANGES if expert_parallel else {})}


def weight_shardings(
    weights: W.Weights, mesh: Mesh, shard_vocab: bool = False, expert_parallel: bool = False
) -> W.Weights:
    return W.shardings(weights, mesh, rules(shard_vocab, expert_parallel))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def _leaves(weights: W.Weights) -> dict[str, Any]:
    flat = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights) if f.name != "layers"}
    flat.update({f.name: getattr(weights.layers, f.name) for f in dataclasses.fields(weights.layers)})
    return flat


def _from_leaves(flat: dict[str, Any]) -> W.Weights:
    layer_names = {f.name for f in dataclasses.fields(W.LayerWeights)}
    return W.Weights(
        layers=W.LayerWeights(**{k: v for k, v in flat.items() if k in layer_names}),
        **{k: v for k, v in flat.items() if k not in layer_names},
    )


def place_weights(
    cfg: ModelConfig, weights: W.Weights, mesh: Mesh, shard_vocab: bool = False, expert_parallel: bool = False
) -> W.Weights:
    """Stacked weights (host numpy or device arrays) on the mesh, KV heads expanded for tp > num_kv_heads. A leaf
    already placed as wanted is kept; any other is copied to the host one leaf at a time and each device gets only
    its slice (make_array_from_callback), so no device holds the whole model."""
    if isinstance(weights.layers, (tuple, list)):
        raise ValueError("place_weights takes stacked layers (place first, then unstack)")
    tp = tp_size(mesh)
    target = _leaves(weight_shardings(_expanded_struct(cfg, weights, tp), mesh, shard_vocab, expert_parallel))
    out = {}
    for name, a in _leaves(weights).items():
        if a is None:
            out[name] = None
            continue
        sharding = target[name]
        if W.is_quantized(a):  # an Fp8Matrix: q and its row scales, each placed by its own sharding
            out[name] = type(a)(*(_placed(x, s) for x, s in ((a.q, sharding.q), (a.scale, sharding.scale))))
            continue
        # by shape, so that placing placed weights again (another rule table) does not expand twice
        expand = name in KV_LEAVES and tp > cfg.num_kv_heads and a.shape[-1] == cfg.num_kv_heads * cfg.head_dim
        out[name] = _placed(expand_kv(np.asarray(a), cfg, tp) if expand else a, sharding)
    return _from_leaves(out)


def _placed(a, sharding: NamedSharding):
    """a on the mesh, each device given only its slice; kept where it is placed so already."""
    if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(sharding, a.ndim):
        return a
    host = np.asarray(a)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx, h=host: h[idx])


def _expanded_struct(cfg, weights, tp):
    """Shape-only Weights after the KV expansion (what the rules are applied to)."""

    def struct(name, a):
        if a is None:
            return None
        if W.is_quantized(a):
            if name in KV_LEAVES and tp > cfg.num_kv_heads:
                raise ValueError(f"{name}: fp8 K/V projections are not copied for tp_size > {cfg.num_kv_heads} heads")
            return type(a)(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (a.q, a.scale)))
        shape = a.shape
        if name in KV_LEAVES and tp > cfg.num_kv_heads and shape[-1] == cfg.num_kv_heads * cfg.head_dim:
            shape = shape[:-1] + (tp * cfg.head_dim,)
        return jax.ShapeDtypeStruct(shape, a.dtype)

    return _from_leaves({n: struct(n, a) for n, a in _leaves(weights).items()})


def unstack_placed(
    weights: W.Weights, mesh: Mesh, shard_vocab: bool = False, expert_parallel: bool = False
) -> W.Weights:
    """Per-layer weights (the accelerators' unrolled forward) from placed stacked ones, each slice keeping its
    leaf's partitioning (a jit with out_shardings: no gather through one device)."""
    struct = jax.eval_shape(W.unstack_layers, weights)
    out = weight_shardings(struct, mesh, shard_vocab, expert_parallel)
    return jax.jit(W.unstack_layers, out_shardings=out)(weights)


def dummy_weights(
    cfg: ModelConfig, mesh: Mesh, seed: int = 0, shard_vocab: bool = False, expert_parallel: bool = False
) -> W.Weights:
    """Random weights born sharded: the initialiser is jitted with out_shardings (jax's partitionable threefry gives
    the same values as the unsharded `weights.dummy_weights`), KV heads then expanded for tp > num_kv_heads."""
    tp = tp_size(mesh)
    table = rules(shard_vocab, expert_parallel)
    if cfg.num_kv_heads % tp:
        table = {**table, "kv_heads": None}  # replicated until expanded
    flat = {name: NamedSharding(mesh, P(*(table.get(n) for n in W.LOGICAL_AXES[name]))) for name in W.shapes(cfg)}
    return place_weights(cfg, W.dummy_weights(cfg, seed, shardings=flat), mesh, shard_vocab, expert_parallel)


def local_value(x):
    """A replicated step output as this process can read it: across hosts, its copy on a local device."""
    return x if x.is_fully_addressable else x.addressable_data(0)


# -- attention under shard_map ---------------------------------------------------------------------------------
def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """jax.shard_map (jax >= 0.7) or jax.experimental.shard_map on older jax; replication checks off (the Pallas
    kernels' outputs carry no replication information)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def sharded_attention(attend, mesh: Mesh):
    """The backend signature over the mesh: each device attends its local heads over its slice of the pool."""

    def attention(q, k, v, pool, layer, meta, *, sm_scale: float, **masks):
        # masks: a family's window / softcap (model/llama.py passes them only when it has them); a window that is
        # a static int stays static (jax's TPU kernel needs that), a traced one (scanned layers) is an operand.
        window = masks.pop("window", 0)
        static = isinstance(window, int)

        def local(q, k, v, pool, layer, meta, win):
            extra = dict(masks)
            if not static or window:
                extra["window"] = window if static else win
            return attend(q, k, v, pool, layer, meta, sm_scale=sm_scale, **extra)

        fn = shard_map(
            local,
            mesh,
            in_specs=(HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, POOL_SPEC, P(), P(), P()),
            out_specs=(HEADS_SPEC, POOL_SPEC),
        )
        return fn(q, k, v, pool, layer, meta, jnp.asarray(0 if static else window, jnp.int32))

    return attention


# -- experts: expert parallelism or tensor-parallel experts, under shard_map ------------------------------------
def experts_for(cfg: ModelConfig, mesh: Mesh | None, kernel: str, expert_parallel: bool = False):
    """The forward's experts_fn: None for a dense model, model/moe.experts with `kernel` (xla | pallas) on one
    device, sharded_experts over a mesh."""
    if not cfg.is_moe:
        return None
    if mesh is not None:
        return sharded_experts(mesh, cfg, kernel, expert_parallel)
    return functools.partial(experts, activation=cfg.activation, kernel=kernel)


def sharded_experts(mesh: Mesh, cfg: ModelConfig, kernel: str = "xla", expert_parallel: bool = False):
    """model/moe.experts over the mesh. The residual stream is replicated (attention is tensor-parallel), so every
    device already holds every token: it routes them all (the same on every device), runs the (token, expert)
    pairs of the experts it holds, and one psum adds the devices' partial outputs: the same single all-reduce of
    [T, D] per layer as a dense tensor-parallel MLP, and no all-to-all (which only pays when the tokens themselves
    are split over the devices, as in data-parallel attention). Expert parallelism (expert_parallel) holds
    E / tp whole experts per device (a grouped matmul per device on tp times fewer groups); otherwise every
    device holds every expert's 1 / tp columns."""
    ep = expert_parallel
    up_spec = P("tensor", None, None) if ep else P(None, None, "tensor")
    down_spec = P("tensor", None, None) if ep else P(None, "tensor", None)

    def local(h, top_w, top_i, w_gate, w_up, w_down):
        first = jax.lax.axis_index("tensor") * w_gate.shape[0] if ep else 0
        part = experts(
            h,
            top_w,
            top_i,
            w_gate,
            w_up,
            w_down,
            first=first,
            activation=cfg.activation,
            out_dtype=jnp.float32,
            kernel=kernel,
        )
        return jax.lax.psum(part, "tensor").astype(h.dtype)

    return shard_map(local, mesh, in_specs=(P(), P(), P(), up_spec, up_spec, down_spec), out_specs=P())


def addressable_bytes(tree) -> dict[int, int]:
    """Bytes each device holds of a pytree of arrays (device id -> bytes)."""
    out: dict[int, int] = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return out
