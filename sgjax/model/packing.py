"""Named segments of one int32 buffer: how a step's host arrays travel to the device in a single transfer.

A layout is an ordered tuple of `Segment`s whose sizes come from the step's static shape. `pack` writes host arrays
into one buffer (float32 segments bit-cast, so the round trip is exact) and checks every size; `unpack` slices the
same layout back inside the jitted step (static offsets). The batch (model/batch.py), the sampling rows
(engine/sampler.py) and the whole step (engine/step.py) all declare their segments here and nowhere else compute an
offset: a layout computed in two places is how a misaligned slice once broke every Mosaic GPU step on the H200.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Segment:
    name: str
    shape: tuple[int, ...]  # the array's shape after unpack; () is a scalar
    dtype: str = "int32"  # "int32" or "float32" (bit-cast into the buffer)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def size(layout: tuple[Segment, ...]) -> int:
    return sum(s.size for s in layout)


def pack(layout: tuple[Segment, ...], values: Mapping[str, Any]) -> np.ndarray:
    """The host arrays of `values` (one per segment, any shape of the right size) in one int32 buffer."""
    parts = []
    for seg in layout:
        a = np.asarray(values[seg.name], np.dtype(seg.dtype)).reshape(-1)
        if a.size != seg.size:
            raise ValueError(f"segment {seg.name!r}: {a.size} values for a size of {seg.size} (shape {seg.shape})")
        parts.append(a.view(np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack(layout: tuple[Segment, ...], buffer) -> dict[str, Any]:
    """The inverse of pack, for a jax or numpy buffer (static slices; traceable)."""
    out, start = {}, 0
    for seg in layout:
        part = buffer[start : start + seg.size]
        start += seg.size
        if seg.dtype == "float32":
            part = jax.lax.bitcast_convert_type(jnp.asarray(part), jnp.float32)
        out[seg.name] = part.reshape(seg.shape)
    return out
