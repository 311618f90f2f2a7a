"""Pre-quantized fp8 HF checkpoints, read as they are: e4m3 matrices with a scale per output row or one per tensor.

Which `quantization_config`s are read (`scheme`):
- compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC exports, what SGLang and vLLM load as `compressed-tensors`):
  8-bit float weights of strategy `channel` (weight_scale [out, 1]) or `tensor` (one scale); their activation
  settings are ignored: sgjax runs them w8a16 (bf16 activations), as its `--quantization fp8`.
- quant_method `fp8` (one scale per tensor, `X.weight_scale`), or with `weight_block_size` [bn, bk] (DeepSeek-V3's
  and Qwen3-FP8's format: `X.weight_scale_inv` [ceil(N / bn), K / bk], multiplied in despite its name).
- compressed-tensors of strategy `block` (`block_structure` [bn, bk], `X.weight_scale` of the same shape).
Anything else (int4/int8 schemes, awq, gptq, ...) is refused by name before loading.

A matrix `X.weight` stored as F8_E4M3 beside its scale becomes an Fp8Matrix [out, in] (model/quant.py): the file's
bytes, no round trip through bf16. Block scales stay per block along a row (each row repeats its row block's), so
a product widens the matrix with them; w8a8 takes row scales only and refuses them. safetensors' numpy reader has
no fp8 type, so tensors of such a checkpoint are read from the file's header and bytes here (ml_dtypes for fp8 and
bf16).
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

from sgjax.model.quant import Fp8Matrix

DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def scheme(hf_config: dict) -> str | None:
    """'channel', 'tensor' or 'block' for an fp8 checkpoint sgjax reads as it is; None for an unquantized one;
    ValueError naming what is not read."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return "block" if block_size(hf_config) else "tensor"
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
            raise ValueError(
                "compressed-tensors checkpoint: only 8-bit float (fp8) weights are read, got "
                f"{[(w.get('type'), w.get('num_bits')) for w in weights]}"
            )
        strategies = {w.get("strategy") for w in weights}
        if len(strategies) > 1 or not strategies <= {"channel", "tensor", "block"}:
            raise ValueError(
                f"compressed-tensors fp8 checkpoint with strategy {sorted(map(str, strategies))}: one of 'channel', "
                "'tensor' and 'block' is read"
            )
        if strategies == {"block"} and block_size(hf_config) is None:
            raise ValueError("compressed-tensors fp8 checkpoint of strategy 'block' without a block_structure")
        return strategies.pop()
    raise ValueError(
        f"checkpoint quantization {method!r} is not read by sgjax (read: compressed-tensors fp8 and fp8 with "
        "per-channel, per-tensor or block scales)"
    )


def block_size(hf_config: dict) -> tuple[int, int] | None:
    """A block-scaled fp8 checkpoint's (bn, bk): rows and columns of a matrix that share one scale; None for
    other checkpoints."""
    qc = hf_config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        given = qc.get("weight_block_size")
    else:
        blocks = [(g.get("weights") or {}).get("block_structure") for g in (qc.get("config_groups") or {}).values()]
        given = blocks[0] if blocks and all(b == blocks[0] for b in blocks) else blocks or None
    if not given:
        return None
    if not (isinstance(given, (list, tuple)) and len(given) == 2 and all(isinstance(n, int) and n > 0 for n in given)):
        raise ValueError(f"fp8 checkpoint: weight_block_size / block_structure must be two positive ints, got {given}")
    return int(given[0]), int(given[1])


def scale_name(weight: str, names) -> str | None:
    """The tensor holding a matrix's scales: `X.weight_scale`, or `X.weight_scale_inv` (the block format's)."""
    return next((weight + suffix for suffix in ("_scale", "_scale_inv") if weight + suffix in names), None)


class RawSafetensors:
    """One .safetensors file's tensors as numpy arrays of its own dtype (memory-mapped)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        self.path, self.start = path, 8 + n

    def keys(self):
        return self.header.keys()

    def get_tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which sgjax does not read")
        begin, end = info["data_offsets"]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.start + begin, shape=(end - begin,))
        return np.asarray(data).view(DTYPES[info["dtype"]]).reshape(info["shape"])


def fp8_matrix(q: np.ndarray, scale: np.ndarray, name: str, block: tuple[int, int] | None = None) -> Fp8Matrix:
    """An e4m3 [out, in] tensor and its weight_scale ([out, 1], [out] or one value; with `block` (bn, bk):
    [ceil(out / bn), in / bk]) as an Fp8Matrix."""
    if q.dtype != ml_dtypes.float8_e4m3fn or q.ndim != 2:
        raise ValueError(f"tensor {name!r}: fp8 weights must be 2-D float8_e4m3fn, got {q.dtype} {q.shape}")
    if block is not None:
        (n, k), (bn, bk) = q.shape, block
        want = (-(-n // bn), -(-k // bk))
        if np.shape(scale) != want:
            raise ValueError(f"tensor {name!r}: block scales of shape {np.shape(scale)}, {want} expected for {block}")
        if k % bk:
            raise ValueError(f"tensor {name!r}: {k} columns are not whole blocks of {bk}; sgjax reads such blocks only")
        return Fp8Matrix(q, np.repeat(np.asarray(scale, np.float32), bn, axis=0)[:n])
    s = np.asarray(scale, np.float32).reshape(-1)
    if s.size == 1:
        s = np.full(q.shape[0], s[0], np.float32)
    if s.shape != (q.shape[0],):
        raise ValueError(f"tensor {name!r}: weight_scale of shape {np.shape(scale)} for {q.shape[0]} output rows")
    return Fp8Matrix(q, s)
