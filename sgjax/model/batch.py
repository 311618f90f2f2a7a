"""The input of one jitted step: a padded ragged batch of new tokens over the paged KV pool."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sgjax.kernels.metadata import AttentionMetadata
from sgjax.model import packing
from sgjax.model.packing import Segment

Array = Any


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    input_ids: Array  # i32[T]
    positions: Array  # i32[T] (RoPE positions)
    attn: AttentionMetadata
    logits_idx: Array  # i32[B]: the rows whose logits are wanted (e.g. each request's last row)


def build_batch(
    token_chunks: list[list[int]],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    num_tokens: int,
    num_reqs: int,
    pages_per_req: int,
    logits_rows: list[int] | None = None,
    num_logits: int | None = None,
) -> StepBatch:
    """Pack requests' new tokens into one padded numpy batch (host side).

    token_chunks[r] are request r's new tokens; they take positions kv_lens[r] - len .. kv_lens[r] - 1
    and their slots come from page_tables[r]. Defaults ask for the last row of every request.
    """
    n = len(token_chunks)
    q_lens = np.fromiter(map(len, token_chunks), np.int64, n)
    total = int(q_lens.sum())
    if n > num_reqs or total > num_tokens:
        raise ValueError(f"batch of {n} requests / {total} tokens exceeds the bucket ({num_reqs}, {num_tokens})")
    # Vectorised over rows: the host builds one of these per step, and a Python loop over the requests showed up in
    # the step's host time.
    num_pages = np.fromiter(map(len, page_tables), np.int64, n)
    kv = np.asarray(kv_lens, np.int64).reshape(n)
    short = np.flatnonzero(num_pages * page_size < kv)
    if short.size:
        r = int(short[0])
        raise ValueError(f"request {r}: {num_pages[r]} pages cannot hold {kv_lens[r]} tokens")
    table = np.zeros((num_reqs, pages_per_req), np.int32)
    page_rows = np.repeat(np.arange(n), num_pages)
    page_cols = np.arange(page_rows.size) - np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
    table[page_rows, page_cols] = np.fromiter(itertools.chain.from_iterable(page_tables), np.int32, page_rows.size)
    cu = np.zeros(num_reqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = total
    lens = np.zeros(num_reqs, np.int32)
    lens[:n] = kv
    req_of_row = np.repeat(np.arange(n), q_lens)
    pos = np.arange(total) - np.repeat(cu[:n], q_lens) + np.repeat(kv - q_lens, q_lens)
    input_ids = np.zeros(num_tokens, np.int32)
    input_ids[:total] = np.fromiter(itertools.chain.from_iterable(token_chunks), np.int32, total)
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = pos
    slots = np.zeros(num_tokens, np.int32)
    slots[:total] = table[req_of_row, pos // page_size] * page_size + pos % page_size
    if logits_rows is None:
        logits_rows = cu[1 : n + 1] - 1
    num_logits = num_logits or num_reqs
    idx = np.zeros(num_logits, np.int32)
    idx[: len(logits_rows)] = logits_rows
    return StepBatch(
        input_ids=input_ids,
        positions=positions,
        attn=AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=lens, page_table=table),
        logits_idx=idx,
    )


@dataclass(frozen=True)
class BatchShape:
    """The static shape of a StepBatch bucket: what a packed buffer needs to be split again."""

    num_tokens: int
    num_reqs: int
    pages_per_req: int
    num_logits: int

    @classmethod
    def of(cls, batch: StepBatch) -> "BatchShape":
        return cls(
            num_tokens=batch.input_ids.shape[0],
            num_reqs=batch.attn.kv_lens.shape[0],
            pages_per_req=batch.attn.page_table.shape[1],
            num_logits=batch.logits_idx.shape[0],
        )

    def layout(self) -> tuple[Segment, ...]:
        """The batch's segments of the step buffer (model/packing.py), in order."""
        t, r = self.num_tokens, self.num_reqs
        return (
            Segment("input_ids", (t,)),
            Segment("positions", (t,)),
            Segment("slot_mapping", (t,)),
            Segment("cu_q_lens", (r + 1,)),
            Segment("kv_lens", (r,)),
            Segment("page_table", (r, self.pages_per_req)),
            Segment("logits_idx", (self.num_logits,)),
        )


def fields(batch: StepBatch) -> dict[str, Array]:
    """The batch's arrays by segment name."""
    a = batch.attn
    return {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "slot_mapping": a.slot_mapping,
        "cu_q_lens": a.cu_q_lens,
        "kv_lens": a.kv_lens,
        "page_table": a.page_table,
        "logits_idx": batch.logits_idx,
    }


def from_fields(d: dict[str, Array]) -> StepBatch:
    return StepBatch(
        input_ids=d["input_ids"],
        positions=d["positions"],
        logits_idx=d["logits_idx"],
        attn=AttentionMetadata(
            slot_mapping=d["slot_mapping"], cu_q_lens=d["cu_q_lens"], kv_lens=d["kv_lens"], page_table=d["page_table"]
        ),
    )


def pack(batch: StepBatch) -> np.ndarray:
    """All of a host batch's int32 metadata in one buffer, so a step costs one host->device transfer."""
    return packing.pack(BatchShape.of(batch).layout(), fields(batch))


def unpack(buffer, shape: BatchShape) -> StepBatch:
    """The inverse of pack, inside the jitted step (static slices of the one transferred buffer)."""
    return from_fields(packing.unpack(shape.layout(), buffer))
