"""What an attention backend sees of a ragged batch (installed as sgjax.kernels.metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax

Array = Any


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """One padded ragged batch over the paged KV pool.

    Request r owns query rows cu_q_lens[r]:cu_q_lens[r+1]; its new K/V occupy positions
    [kv_lens[r] - q_len, kv_lens[r]) of its sequence, so kv_lens[r] > q_len means a cached prefix.
    Padded rows (past cu_q_lens[-1]) write to slot 0 of the null page 0; padded requests have
    q_len 0 and kv_len 0 and a page table of zeros.
    """

    slot_mapping: Array  # i32[T]: page * page_size + offset of each new token's K/V
    cu_q_lens: Array  # i32[R+1]
    kv_lens: Array  # i32[R]
    page_table: Array  # i32[R, P]
