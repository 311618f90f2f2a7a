"""Helpers for the FSM tests: a small synthetic vocabulary, a fake model, a regex strategy."""

import re

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from sgjax.fsm.vocab import Vocabulary

# Multi-byte tokens chosen to cross JSON structure, and to split UTF-8 characters (\xc3 | \xa9).
_MULTI = [
    b'{"',
    b'":',
    b'": "',
    b'", "',
    b'"}',
    b' "',
    b"ab",
    b"abc",
    b"bc",
    b"ca",
    b"aa",
    b"12",
    b"0.",
    b"true",
    b"fa",
    b"lse",
    b"null",
    b"na",
    b"me",
    b"name",
    b"\xc3",
    b"\xa9",
    b"\xc3\xa9",
    b"\xa9a",
    b"\xe4\xb8",
    b"\xad",
    b", ",
    b"[]",
    b"{}",
    b'": [',
    b"xyz",
    b"  ",
    b"\\n",
    b"\\u00",
    b'"\n',
]
SPECIAL, EOS = 0, 1
# Deterministic (derandomized) so a run is reproducible and the suite stays inside its time budget.
SETTINGS = settings(
    derandomize=True,
    deadline=None,
    max_examples=25,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _toy_vocab() -> Vocabulary:
    tokens = [None, None] + [bytes([b]) for b in range(256)] + _MULTI
    ordered = sorted(((t, i) for i, t in enumerate(tokens) if t), key=lambda p: -len(p[0]))

    def encode(text: str) -> list[int]:  # greedy longest match: a stand-in for BPE
        data, out = text.encode(), []
        while data:
            t, i = next(p for p in ordered if data.startswith(p[0]))
            out.append(i)
            data = data[len(t) :]
        return out

    return Vocabulary(tokens=tuple(tokens), eos_ids=frozenset([EOS]), encode=encode, name="toy")


TOY = _toy_vocab()


def decode(vocab: Vocabulary, ids) -> bytes:
    return b"".join(vocab.tokens[i] or b"" for i in ids if i not in vocab.eos_ids)


def fake_logits(seq, vocab_size: int) -> np.ndarray:
    """A deterministic stand-in for a model: logits depend only on the token sequence."""
    rng = np.random.default_rng(abs(hash(tuple(seq))) % (2**32))
    return rng.normal(size=vocab_size).astype(np.float32)


# --- random regexes from the dialect's features ---------------------------------------------
ALPHABET = 'ab{}":., é中-'
_LEAVES = st.sampled_from(
    [re.escape(c) for c in ALPHABET]
    + ["[a-c]", "[^a]", "[ab\u00e9]", r"\d", r"\w", r"\s", r"\W", ".", r"[\d.]", r"\x41", '[^"\\\\]']
)


def _combine(children):
    return st.one_of(
        st.lists(children, min_size=2, max_size=3).map("".join),
        st.lists(children, min_size=2, max_size=3).map(lambda xs: "(?:" + "|".join(xs) + ")"),
        st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?"])).map(
            lambda t: f"(?:{t[0]}){t[1]}"
        ),
        children.map(lambda x: f"({x})"),
    )


REGEXES = st.recursive(_LEAVES, _combine, max_leaves=8)


def random_match(dfa, rng, max_len: int = 40) -> bytes | None:
    """A random string the DFA accepts (stop at an accepting state with some probability)."""
    state, out = 0, bytearray()
    for _ in range(max_len):
        nxt = dfa.out_bytes(state)
        if dfa.accepting[state] and (not nxt or rng.random() < 0.3):
            return bytes(out)
        b = int(rng.choice(nxt))
        out.append(b)
        state = dfa.step(state, bytes([b]))
    return None
