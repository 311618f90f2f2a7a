"""GGUF reading with numpy only: the metadata and the tensors' raw (still quantized) data, memory-mapped.

The `gguf` package's GGUFReader builds a numpy view per metadata element: opening Gemma-3-270M's file (a
262,144-token vocabulary, three arrays of that length) was most of a model load. This reader parses the same format
(GGUF v2/v3: header, key/value pairs, tensor infos, aligned data) without them; `gguf` is
still what dequantizes (loader.py).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np


class GGUFError(ValueError):
    """A GGUF file that cannot be read or holds something we do not support."""


# GGUF value types -> (struct format, numpy dtype) of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (the file lists dimensions fastest first)
    data: np.ndarray  # memory-mapped: float arrays in `shape`, quantized ones as uint8 rows of blocks


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict
    tensors: tuple[Tensor, ...]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFError(f"unknown GGUF value type {kind}")
        elem, count = self.unpack("<IQ")
        if elem in _SCALARS:  # one read for the whole array
            dtype = np.dtype(_SCALARS[elem][1]).newbyteorder("<")
            out = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return out.tolist()
        return [self.value(elem) for _ in range(count)]


def _read(path: str) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, np.uint8, mode="r")
    c = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise GGUFError("not a GGUF file (bad magic)")
    c.pos = 4
    version, n_tensors, n_kv = c.unpack("<IQQ")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2, 3)")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
        kind, offset = c.unpack("<IQ")
        infos.append((name, dims, kind, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))
        count = int(np.prod(dims))
        nbytes = count // block * type_size
        raw = buf[start + offset : start + offset + nbytes]
        if len(raw) != nbytes:
            raise GGUFError(f"tensor {name!r} runs past the end of the file (truncated?)")
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            dtype = {
                GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.BF16: np.uint16,
            }[qtype]
            data = raw.view(dtype).reshape(shape)
        else:  # rows of quantized blocks, the layout gguf.dequantize takes
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(Tensor(name, qtype, shape, data))
    return GGUFFile(meta, tuple(tensors))


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    try:
        return _read(path)
    except GGUFError as e:
        raise GGUFError(f"cannot read GGUF file {path!r}: {e}") from e
    except Exception as e:  # truncated or corrupt files fail in many ways
        raise GGUFError(f"cannot read GGUF file {path!r}: {type(e).__name__}: {e}") from e


def read_metadata(path: str) -> dict:
    return open_gguf(path).metadata


def layer_matrix_types(path: str) -> frozenset[str]:
    """The quantization types (GGML names: Q4_1, Q8_0, F16, ...) of a GGUF's layer matrices (the 2-D blk.*
    tensors), from its header alone."""
    return frozenset(
        t.tensor_type.name for t in open_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )
