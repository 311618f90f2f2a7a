"""The contract between the host and one jitted step: its static shape, its one int32 buffer, the sentinel ids the
buffer may carry (engine/sentinels.py), and the device state each step donates and returns.

The buffer is, in order (model/packing.py segments, sizes from `StepShape`): the batch (model/batch.py: input_ids,
positions, slot_mapping, cu_q_lens, kv_lens, page_table, logits_idx), the sampling rows (engine/sampler.py: the
per-row fields, the penalty window and its biases, two flags), then, when the shape has them, each token row's image
feature row (vision models), the packed allowed-token bits of each logits row (constrained decoding) and each token
row's LoRA slot (adapters served).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sgjax.engine import sampler
from sgjax.model import batch as batch_mod
from sgjax.model import packing
from sgjax.model.batch import BatchShape, StepBatch
from sgjax.model.packing import Segment

Array = Any


# -- the static shape ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    batch: BatchShape
    history: int  # W
    top_logprobs: int  # K
    mask_words: int = 0  # ceil(V / 32) when a row is constrained (packed allowed-token bits per row), else 0
    image_rows: int = 0  # M: feature rows of the images in the step's chunks (vision models), else 0
    branches: sampler.Branches = sampler.ON_DEVICE  # the sampler's optional parts: static, or lax.conds (CPU)
    lora: int = 0  # 1: the engine serves LoRA adapters, and each token row names its slot (model/lora.py)

    def layout(self) -> tuple[Segment, ...]:
        b = self.batch
        out = b.layout() + sampler.sampling_layout(b.num_logits, self.history)
        if self.image_rows:
            out += (Segment("image_rows", (b.num_tokens,)),)
        if self.mask_words:
            out += (Segment("mask", (b.num_logits, self.mask_words)),)
        if self.lora:
            out += (Segment("lora_slots", (b.num_tokens,)),)
        return out

    @property
    def size(self) -> int:
        return packing.size(self.layout())

    def to_words(self) -> tuple[int, ...]:
        """The shape as int32 words, one per field in declaration order, nested dataclasses (the batch shape, the
        sampler's branches) flattened in place; an optional bool is -1 (None), 0 or 1. Multi-host steps broadcast
        it (engine/distributed.py); `from_words` reads it back."""
        return tuple(_words(self))

    @classmethod
    def from_words(cls, words) -> "StepShape":
        shape, rest = _read(cls, [int(w) for w in words])
        if rest:
            raise ValueError(f"StepShape.from_words: {len(rest)} words left over")
        return shape


def _words(obj) -> list[int]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _words(value)
        else:
            out.append(-1 if value is None else int(value))
    return out


def _read(cls, words: list[int]):
    """(an instance of cls from the front of words, the words left)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            values[f.name], words = _read(kind, words)
            continue
        word, words = words[0], words[1:]
        if kind is int:
            values[f.name] = word
        elif set(typing.get_args(kind)) == {bool, type(None)}:  # bool | None
            values[f.name] = None if word < 0 else bool(word)
        else:
            raise TypeError(f"StepShape.from_words: field {f.name} of {cls.__name__} is {kind}, not int or bool | None")
    return cls(**values), words


SHAPE_WORDS = len(StepShape(BatchShape(0, 0, 0, 0), 0, 0).to_words())


def pack(
    shape: StepShape, batch: StepBatch, rows: dict[str, np.ndarray], image_rows=None, mask=None, lora_slots=None
) -> np.ndarray:
    """The whole step's host arrays in its one buffer. `image_rows`, `mask` and `lora_slots` must be given exactly
    when the shape has them."""
    values = {**batch_mod.fields(batch), **sampler.sampling_values(rows)}
    if shape.image_rows:
        values["image_rows"] = image_rows
    if shape.mask_words:
        values["mask"] = mask
    if shape.lora:
        values["lora_slots"] = lora_slots
    return packing.pack(shape.layout(), values)


def unpack(
    buffer, shape: StepShape
) -> tuple[StepBatch, sampler.SamplingBatch, Array | None, Array | None, Array | None]:
    """(batch, sampling rows, image_rows, packed mask words, each row's LoRA slot; None where the shape has none),
    inside the jitted step."""
    d = packing.unpack(shape.layout(), buffer)
    batch = batch_mod.from_fields({s.name: d[s.name] for s in shape.batch.layout()})
    rows = sampler.from_values(
        {s.name: d[s.name] for s in sampler.sampling_layout(shape.batch.num_logits, shape.history)}
    )
    return batch, rows, d.get("image_rows"), d.get("mask"), d.get("lora_slots")


# -- device state ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclass
class DeviceState:
    """What every step donates and gets back: the KV pool [L, pages, page_size, 2*Hkv, D] and the future-token
    array [max running requests] (each running request's newest sampled token at its slot, for the overlap loop).
    A failed step may take both: the runner then makes a fresh one (and the cache forgets its pages)."""

    pool: Array
    future: Array
    # a mixture of experts' (token, choice) pairs per layer and expert since the pool was made, i32[L, E]: counted on
    # the device, read only when /metrics or the server info asks (no per-step transfer)
    expert_tokens: Array | None = None

    def lost(self) -> bool:
        arrays = (self.pool, self.future) + (() if self.expert_tokens is None else (self.expert_tokens,))
        return any(a.is_deleted() for a in arrays)
