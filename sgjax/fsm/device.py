"""Device-side FSM tables and pure mask functions.

What the engine uses today: `unpack_bits` only (the step unpacks each constrained row's packed mask words, which the
host copies from the grammar's table because it advances the FSM itself: it needs every token for stops and
jump-forward). The arena below (`DeviceTables`, `advance`, `allowed_mask`) is NOT wired into the engine: it is the
building block for keeping grammar rows' FSM state on the device so that their steps can overlap (docs/engine.md,
Known gaps), and is tested on its own (tests/fsm/test_device.py).

Several grammars share one set of arrays (an arena) with global state ids, so a batch mixing
grammars and unconstrained rows is one gather: the state alone says which grammar a row follows.
State 0 is FREE (every token allowed, self loop) for unconstrained rows. Grammar g's local state s
is `offsets[g] + s`. Capacities pad the arrays to fixed shapes so that adding a grammar does not
recompile the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

FREE = 0


@dataclass(frozen=True)
class DeviceTables:
    token_class: jax.Array  # int32[G, V]: per grammar slot, token -> class (slot 0 = FREE)
    class_next: jax.Array  # int32[S, C]: global next state
    grammar_of: jax.Array  # int32[S]: grammar slot of each global state
    mask_bits: jax.Array  # int32[S, ceil(V/32)]: packed allowed tokens
    vocab_size: int  # static

    @property
    def num_states(self) -> int:
        return self.class_next.shape[0]


jax.tree_util.register_dataclass(
    DeviceTables, data_fields=["token_class", "class_next", "grammar_of", "mask_bits"], meta_fields=["vocab_size"]
)


def pack_tables(
    grammars: Sequence,
    vocab_size: int,
    *,
    state_capacity: int | None = None,
    class_capacity: int | None = None,
    grammar_capacity: int | None = None,
) -> tuple[DeviceTables, list[int]]:
    """Arena of `grammars` (CompiledGrammar); returns the tables and each grammar's state offset.

    Transitions the mask forbids are pointed at the grammar's done state so every gather stays in
    range; they are never taken, since the sampler only draws allowed tokens.
    """
    words = -(-vocab_size // 32)
    offsets, base = [], 1
    for g in grammars:
        if g.vocab_size != vocab_size:
            raise ValueError(f"grammar vocab size {g.vocab_size} != {vocab_size}")
        offsets.append(base)
        base += g.num_states
    num_states = max(base, state_capacity or 0)
    num_classes = max([1] + [g.tables.num_classes for g in grammars] + [class_capacity or 0])
    num_slots = max(len(grammars) + 1, grammar_capacity or 0)
    if (state_capacity and base > state_capacity) or (grammar_capacity and len(grammars) + 1 > grammar_capacity):
        raise ValueError("grammars exceed the arena capacity")

    token_class = np.zeros((num_slots, vocab_size), np.int32)
    class_next = np.zeros((num_states, num_classes), np.int32)  # padding rows: FREE-like self loops to 0
    grammar_of = np.zeros(num_states, np.int32)
    mask_bits = np.zeros((num_states, words), np.int32)
    mask_bits[FREE] = _all_tokens(vocab_size, words)
    for slot, (g, off) in enumerate(zip(grammars, offsets), start=1):
        n, c = g.tables.class_next.shape
        local = g.tables.class_next
        token_class[slot] = g.tables.token_class
        class_next[off : off + n, :c] = np.where(local >= 0, local, g.done) + off
        class_next[off : off + n, c:] = off + g.done
        grammar_of[off : off + n] = slot
        mask_bits[off : off + n] = g.mask_bits
    tables = DeviceTables(
        jnp.asarray(token_class), jnp.asarray(class_next), jnp.asarray(grammar_of), jnp.asarray(mask_bits), vocab_size
    )
    return tables, offsets


def _all_tokens(vocab_size: int, words: int) -> np.ndarray:
    bits = np.zeros(words * 32, bool)
    bits[:vocab_size] = True
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def unpack_bits(words: jax.Array, vocab_size: int) -> jax.Array:
    """int32[..., W] packed masks -> bool[..., V]; the layout llguidance/xgrammar host masks use."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (words[..., :, None] >> shifts) & 1  # arithmetic shift is fine: we keep only bit 0
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


def allowed_mask(tables: DeviceTables, states: jax.Array) -> jax.Array:
    """int32[B] states -> bool[B, V]."""
    return unpack_bits(tables.mask_bits[states], tables.vocab_size)


def apply_bitmask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """Mask logits[B, V] with packed int32[B, W] bits (also the entry point for a host backend)."""
    keep = unpack_bits(words, logits.shape[-1])
    return jnp.where(keep, logits, jnp.asarray(-jnp.inf, logits.dtype))


def apply_mask(logits: jax.Array, tables: DeviceTables, states: jax.Array) -> jax.Array:
    return apply_bitmask(logits, tables.mask_bits[states])


def advance(tables: DeviceTables, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32[B] states, int32[B] sampled tokens -> int32[B] next states."""
    cls = tables.token_class[tables.grammar_of[states], tokens]
    return tables.class_next[states, cls]
