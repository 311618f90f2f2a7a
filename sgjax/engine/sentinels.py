"""Every int32 value the host writes into a step's buffer besides a real token id, in one place.

input_ids: `future_input(slot)` is a token the previous step sampled that the host has not read yet (the overlap
loop); the step reads it from slot `slot` of the future-token array.
The penalty window (the sampler's `history` rows): a generated id as is; a prompt id as `prompt_entry` (it counts for
the repetition penalty only); a logit_bias entry as `bias_entry` (its bias beside it in the window's `bias` row);
`future_history(slot)` for the token in flight; `HISTORY_PAD` for an empty slot.
"""

from __future__ import annotations

import jax.numpy as jnp

HISTORY_PAD = -1


def future_input(slot: int) -> int:
    return -1 - slot


def future_slot(entry):
    """The slot a future_input entry names."""
    return -1 - entry


def future_history(slot):
    return -2 - slot


def prompt_entry(token, vocab: int):
    return token + vocab


def bias_entry(token, vocab: int):
    return token + 2 * vocab


def is_bias_entry(entry, vocab: int):
    return entry >= 2 * vocab


def bias_token(entry, vocab: int):
    return entry - 2 * vocab


def resolve_future(ids, future, first: int):
    """On the device: ids with every sentinel `first - slot` (first = -1 for inputs, -2 for windows) replaced by
    future[slot]."""
    slots = future.shape[0]
    return jnp.where(ids <= first, future[jnp.clip(first - ids, 0, slots - 1)], ids)
