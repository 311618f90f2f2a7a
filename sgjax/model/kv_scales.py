"""Scales of an fp8 KV pool: the pool stores saturate(k / k_scale) and saturate(v / v_scale), per layer (or per layer
and KV head), so keys and values of any magnitude use the format's range and precision instead of clipping at its
largest value or flushing to its smallest.

Where they come from (engine/plan.py takes the first it finds; the plan prints which):
1. `--quantization-param-path`: vLLM's and SGLang's JSON, one scale per layer for K and V both, per TP rank:
   {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp rank>": {"<layer>": scale, ...}}}}.
   `sgjax kv-scales` writes one from a model's own keys and values (`calibrate`).
2. The checkpoint's tensors (an HF directory): `model.layers.{i}.self_attn.k_scale` / `v_scale` (vLLM's and
   compressed-tensors' names: one value, or one per KV head), or the older `k_proj.output_scale` /
   `v_proj.output_scale`, or one `kv_scale` for both.
3. None of them: 1.0, what SGLang and vLLM use when nothing gives a scale (the pool saturates at 448 for e4m3).

Applied around the attention backends, not inside them: the scores are linear in the keys and the output in the
values, so attend(q * ks, k / ks, v / vs) * vs equals attend(q, k, v) with the pool holding k / ks and v / vs.
Every backend (ref, cpu, the Triton and TPU kernels, under shard_map too) reads a scaled pool unchanged, and the new
tokens' own keys, which some backends read before they reach the pool, are scaled alike.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import jax.numpy as jnp
import numpy as np

FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# The checkpoint tensor names that hold a layer's K and V scales, under `model.layers.{i}.`; each pair's first
# present one is taken.
CHECKPOINT_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    ("self_attn.kv_scale", "self_attn.kv_scale"),
)


@dataclasses.dataclass(frozen=True)
class KvScales:
    """Per layer, the keys' and the values' scale: a float, or a tuple of one per KV head. Frozen and hashable: part
    of the step plan (the scales are constants of the step's program)."""

    k: tuple
    v: tuple
    source: str

    def tables(self, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) f32[L, num_kv_heads]: a layer's one scale over its heads; per-head scales repeated in place when
        tensor parallelism copied each KV head (engine/mesh.expand_kv's order)."""

        def table(per_layer):
            rows = [np.atleast_1d(np.asarray(s, np.float32)) for s in per_layer]
            return np.stack([np.repeat(r, num_kv_heads // r.size) for r in rows])

        return table(self.k), table(self.v)

    def describe(self) -> str:
        lo = min(float(np.min(s)) for s in (*self.k, *self.v))
        hi = max(float(np.max(s)) for s in (*self.k, *self.v))
        return f"{self.source} ({len(self.k)} layers, {lo:.3g} to {hi:.3g})"


def _check(per_layer, num_layers: int, num_kv_heads: int, where: str) -> tuple:
    if len(per_layer) != num_layers:
        raise ValueError(f"{where}: scales for {len(per_layer)} layers, the model has {num_layers}")
    out = []
    for i, s in enumerate(per_layer):
        a = np.atleast_1d(np.asarray(s, np.float64)).reshape(-1)
        if a.size not in (1, num_kv_heads) or not (np.isfinite(a).all() and (a > 0).all()):
            raise ValueError(
                f"{where}: layer {i}'s scale must be one positive number or one per KV head ({num_kv_heads}), "
                f"got {a.tolist()}"
            )
        out.append(float(a[0]) if a.size == 1 else tuple(float(x) for x in a))
    return tuple(out)


def from_json(path: str, pool_dtype: str, num_layers: int, num_kv_heads: int, tp_size: int = 1) -> KvScales:
    """vLLM's / SGLang's --quantization-param-path file. One TP rank's scales serve every rank; a file with one set
    per rank (tp_size of them) gives each rank's KV heads that rank's scales."""
    where = f"quantization_param_path {path!r}"
    try:
        with open(path) as f:
            doc = json.load(f)
        kv = doc["kv_cache"]
        dtype, by_rank = kv["dtype"], kv["scaling_factor"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a KV cache scales file ({type(e).__name__}: {e})") from None
    if dtype != pool_dtype:
        raise ValueError(f"{where}: scales for a {dtype} cache, the pool is {pool_dtype}")
    if not isinstance(by_rank, dict) or len(by_rank) not in (1, tp_size):
        raise ValueError(f"{where}: scaling_factor must hold one TP rank's scales or {tp_size}' ranks'")
    try:
        ranks = [by_rank[str(r)] for r in range(len(by_rank))]
        layers = [[float(rank[str(i)]) for i in range(len(rank))] for rank in ranks]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: scaling_factor must map ranks 0.. to layers 0.. to numbers ({e})") from None
    if len(ranks) == 1:
        per_layer = layers[0]
    else:  # rank r holds KV heads [r * H / tp, (r + 1) * H / tp)
        heads = max(num_kv_heads, tp_size) // tp_size
        per_layer = [tuple(layers[r][i] for r in range(tp_size) for _ in range(heads)) for i in range(num_layers)]
        num_kv_heads = heads * tp_size
    scales = _check(per_layer, num_layers, num_kv_heads, where)
    return KvScales(scales, scales, f"quantization_param_path {os.path.basename(path)}")


def from_checkpoint(path: str | None, num_layers: int, num_kv_heads: int) -> KvScales | None:
    """An HF directory's own K/V scale tensors (CHECKPOINT_NAMES), None when it has none (or is not one)."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from sgjax.model.fp8_checkpoint import RawSafetensors

    files = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        h = RawSafetensors(f)
        files.update(dict.fromkeys(h.keys(), h))
    for k_name, v_name in CHECKPOINT_NAMES:
        names = [(f"model.layers.{i}.{k_name}", f"model.layers.{i}.{v_name}") for i in range(num_layers)]
        if not any(k in files for k, _ in names):
            continue
        missing = [k for pair in names for k in pair if k not in files]
        if missing:
            raise ValueError(f"{path}: the checkpoint's KV cache scales are incomplete: {missing[:3]} missing")
        read = lambda n: np.asarray(files[n].get_tensor(n), np.float32)  # noqa: E731
        k = _check([read(a) for a, _ in names], num_layers, num_kv_heads, path)
        v = _check([read(b) for _, b in names], num_layers, num_kv_heads, path)
        return KvScales(k, v, "checkpoint")
    return None


def scaled(attend, scales: KvScales):
    """The attention backend `attend` over a pool holding k / ks and v / vs (module docstring)."""

    def attention(q, k, v, pool, layer, meta, *, sm_scale: float, **masks):
        heads = k.shape[1]
        ks_table, vs_table = scales.tables(heads)
        ks, vs = jnp.asarray(ks_table)[layer], jnp.asarray(vs_table)[layer]  # [Hkv] of this (maybe traced) layer
        group = q.shape[1] // heads
        per_q = lambda s: jnp.repeat(s, group)[None, :, None]  # noqa: E731  (query head j reads KV head j // group)
        q = (q * per_q(ks)).astype(q.dtype)
        k = (k / ks[None, :, None]).astype(k.dtype)
        v = (v / vs[None, :, None]).astype(v.dtype)
        out, pool = attend(q, k, v, pool, layer, meta, sm_scale=sm_scale, **masks)
        return (out * per_q(vs)).astype(out.dtype), pool

    return attention


def calibrate(pool, pool_dtype: str = "float8_e4m3fn", headroom: float = 1.0) -> dict:
    """A --quantization-param-path document from a pool (of a wider dtype) that holds a model's keys and values
    for representative prompts: each layer's scale is the largest magnitude of its keys and values over the pool
    (unwritten pages are zeros) times `headroom`, over the fp8 format's largest value (one scale for K and V: the
    file's format)."""
    peak = np.array([float(jnp.max(jnp.abs(pool[i]))) for i in range(pool.shape[0])])  # a layer at a time
    scale = np.where(peak > 0, peak * headroom / FP8_MAX[pool_dtype], 1.0)
    return {"kv_cache": {"dtype": pool_dtype, "scaling_factor": {"0": {str(i): float(s) for i, s in enumerate(scale)}}}}
