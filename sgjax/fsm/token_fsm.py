"""Byte DFA x vocabulary -> token-level transition tables.

A token is allowed in state s iff walking its bytes from s never hits the dead state; the state it
lands in is the next state. Rather than walking 49k tokens from every state, tokens are first
rewritten as sequences of the DFA's byte classes: tokens with the same class sequence behave
identically, so only the distinct sequences are walked (a few thousand for a JSON schema), for all
states at once with numpy. Tokens whose columns (next state for every state) agree then share a
token class, and the table is `class_next[state, token_class[token]]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgjax.fsm import budget
from sgjax.fsm.automaton import ByteDFA
from sgjax.fsm.vocab import Vocabulary


@dataclass(frozen=True)
class TokenTables:
    """States 0..S-1 are the byte DFA's; state `done` = S is entered by EOS and allows only EOS.

    class_next[s, c] is -1 where tokens of class c are not allowed in s.
    """

    token_class: np.ndarray  # int32[V]
    class_next: np.ndarray  # int32[S+1, C]
    accepting: np.ndarray  # bool[S+1]

    @property
    def done(self) -> int:
        return self.class_next.shape[0] - 1

    @property
    def num_states(self) -> int:
        return self.class_next.shape[0]

    @property
    def num_classes(self) -> int:
        return self.class_next.shape[1]

    def next_state(self, state: int, token: int) -> int:
        return int(self.class_next[state, self.token_class[token]])

    def allowed(self, states=None) -> np.ndarray:
        """bool[len(states), V] (all states when None)."""
        rows = self.class_next if states is None else self.class_next[np.asarray(states)]
        return (rows >= 0)[:, self.token_class]


def build_token_tables(dfa: ByteDFA, vocab: Vocabulary) -> TokenTables:
    num_states = dfa.num_states
    mat, lens = vocab.byte_matrix
    text = np.flatnonzero(lens > 0)
    seqs, inverse, seq_lens = _distinct_class_sequences(dfa.byte_class, mat[text], lens[text], dfa.trans.shape[1])
    st, sq, end = _walk(dfa.trans, seqs, seq_lens)
    # Two extra columns: EOS (accepting -> done) and "never" (specials: no entries at all).
    eos_col, never_col = len(seqs), len(seqs) + 1
    acc = np.flatnonzero(dfa.accepting).astype(np.int32)
    st = np.concatenate([st, acc])
    sq = np.concatenate([sq, np.full(acc.size, eos_col, np.int32)])
    end = np.concatenate([end, np.full(acc.size, num_states, np.int32)])
    col_class, num_classes = _column_classes(st, sq, end, num_states, len(seqs) + 2)

    class_next = np.full((num_states + 1, num_classes), -1, np.int32)
    class_next[st, col_class[sq]] = end
    class_next[num_states, col_class[eos_col]] = num_states
    token_class = np.full(vocab.size, col_class[never_col], np.int32)
    token_class[text] = col_class[inverse]
    token_class[np.array(sorted(vocab.eos_ids), dtype=np.int64)] = col_class[eos_col]
    accepting = np.concatenate([dfa.accepting, [False]])
    return TokenTables(token_class=token_class, class_next=class_next, accepting=accepting)


def _distinct_class_sequences(byte_class, mat, lens, pad):
    """Distinct class sequences of the tokens: (sequences, index of each token's, their lengths)."""
    cls = byte_class[mat].astype(np.uint16)
    cls[np.arange(mat.shape[1])[None, :] >= lens[:, None]] = pad
    # Rows viewed as opaque byte strings: one 1-D sort, far faster than np.unique(axis=0).
    rows = np.ascontiguousarray(cls).view(np.dtype((np.void, cls.shape[1] * cls.itemsize))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    return cls[first].astype(np.int32), inverse.reshape(-1).astype(np.int32), lens[first]


def _walk(trans: np.ndarray, seqs: np.ndarray, seq_lens: np.ndarray):
    """Sparse walk of every sequence from every state: (state, sequence, end state) of the live ones.

    Pairs are seeded only where the first byte class is live, and dropped as soon as they die, so
    states that allow few bytes (most of a JSON schema) cost almost nothing.
    """
    first = seqs[:, 0]
    order = np.argsort(first, kind="stable").astype(np.int32)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(first, minlength=trans.shape[1]))])
    st_parts, sq_parts = [], []
    for c in range(trans.shape[1]):
        live = np.flatnonzero(trans[:, c] >= 0).astype(np.int32)
        group = order[bounds[c] : bounds[c + 1]]
        if live.size and group.size:
            st_parts.append(np.repeat(live, group.size))
            sq_parts.append(np.tile(group, live.size))
    empty = np.zeros(0, np.int32)
    if not st_parts:
        return empty, empty, empty
    st, sq = np.concatenate(st_parts), np.concatenate(sq_parts)
    cur = trans[st, first[sq]]
    out = [(empty, empty, empty)]
    for i in range(1, int(seq_lens.max()) + 1):
        budget.check()
        finished = seq_lens[sq] == i
        out.append((st[finished], sq[finished], cur[finished]))
        st, sq, cur = st[~finished], sq[~finished], cur[~finished]
        if not st.size:
            break
        cur = trans[cur, seqs[sq, i]]
        alive = cur >= 0
        st, sq, cur = st[alive], sq[alive], cur[alive]
    return tuple(np.concatenate(parts).astype(np.int32) for parts in zip(*out))


def _column_classes(st, sq, end, num_states, num_cols):
    """Group columns (sequence -> next state, for every state) that are equal.

    Columns are compared by two independent 64-bit hashes of their (state, end) entries, built with
    one scatter-add instead of a dense [S, U] matrix; a false merge needs a 128-bit collision.
    """
    rng = np.random.default_rng(0x5EED)
    keys = []
    for _ in range(2):
        mult = rng.integers(1, 2**63, size=num_states, dtype=np.uint64) | np.uint64(1)
        h = np.zeros(num_cols, np.uint64)
        np.add.at(h, sq, (end.astype(np.uint64) + np.uint64(1)) * mult[st])
        keys.append(h)
    _, col_class = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
    col_class = col_class.reshape(-1).astype(np.int32)
    return col_class, int(col_class.max()) + 1


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """bool[R, V] -> int32[R, ceil(V/32)], bit (t % 32) of word t // 32, the llguidance layout."""
    rows, v = allowed.shape
    width = -(-v // 32) * 32
    padded = np.zeros((rows, width), dtype=bool)
    padded[:, :v] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def unpack_mask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    as_bytes = np.ascontiguousarray(bits).astype("<i4").view(np.uint8).reshape(bits.shape[0], -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size].astype(bool)
