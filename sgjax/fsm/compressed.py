"""The compressed FSM (paper Section 4) and the canonical forced-token rule.

Byte level: a non-accepting state with exactly one outgoing byte is "singular"; chains of singular
edges merge into one compressed edge whose text is the jump string, ending at the first state that
branches or accepts.

Token level: the jump string must become tokens. Upstream SGLang retokenized prefix + jump string,
which can re-split tokens the model already chose, and its outputs then differed from decoding
without jump-forward (sglang #2045). We instead fix, per state, the *canonical* forced token: the
first token of the tokenizer's own split of the forced text. The mask of such a state allows only
that token, so decoding without jump-forward emits exactly the tokens a jump would append; a jump is
just several of those forced steps done in one extend. Equality with and without jump-forward
therefore holds by construction, for any model and any sampler (docs/fsm.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgjax.fsm.automaton import ByteDFA
from sgjax.fsm.token_fsm import TokenTables
from sgjax.fsm.vocab import Vocabulary


@dataclass(frozen=True)
class Jump:
    """Forced continuation from a state: tokens to append in one extend and the state after them."""

    tokens: tuple[int, ...]
    text: bytes
    state: int


def forced_bytes(dfa: ByteDFA) -> np.ndarray:
    """int32[S]: the single byte a state must emit next, or -1 (branching or accepting)."""
    live = dfa.trans[:, dfa.byte_class] >= 0  # [S, 256]
    count = live.sum(axis=1)
    forced = np.where((count == 1) & ~dfa.accepting, live.argmax(axis=1), -1)
    return forced.astype(np.int32)


def jump_strings(dfa: ByteDFA) -> tuple[list[bytes], np.ndarray]:
    """Per state: the compressed edge text (maximal forced byte chain) and its destination state.

    Singular chains cannot loop: a cycle of non-accepting states with one exit each never reaches
    acceptance, and the DFA is trimmed, so every chain ends.
    """
    forced = forced_bytes(dfa)
    n = dfa.num_states
    text: list[bytes | None] = [None] * n
    dst = np.full(n, -1, np.int32)
    for s in range(n):
        path, cur = [], s
        while text[cur] is None and forced[cur] >= 0:
            path.append(cur)
            cur = int(dfa.trans[cur, dfa.byte_class[forced[cur]]])
        if text[cur] is None:
            text[cur], dst[cur] = b"", cur
        for p in reversed(path):
            nxt = int(dfa.trans[p, dfa.byte_class[forced[p]]])
            text[p], dst[p] = bytes([forced[p]]) + text[nxt], dst[nxt]
    return text, dst


def _text_prefix(data: bytes) -> str | None:
    """The longest prefix of `data` that is complete UTF-8 text; None if it starts mid-character."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        return data[: e.start].decode() if e.start > 0 else None


def canonical_tokens(tables: TokenTables, jumps: list[bytes], vocab: Vocabulary) -> np.ndarray:
    """int32[S+1]: the only token allowed in a forced state, or -1 where the mask stays free.

    A state gets a canonical token when its forced text is valid UTF-8, the tokenizer spells it
    exactly, and the first token of that split either is followed by more forced tokens or cannot be
    extended by a longer allowed token. The last condition holds back a token that might merge with
    the free text after the chain (e.g. `"` before a string value that could start with `"A`).
    """
    canon = np.full(tables.num_states, -1, np.int32)
    if vocab.encode is None:
        return canon
    seen: dict[str, list[int] | None] = {}
    for s, data in enumerate(jumps):
        if not data:
            continue
        text = _text_prefix(data)
        if not text:
            continue
        if text not in seen:
            ids = list(vocab.encode(text))
            spelled = b"".join(vocab.tokens[i] or b"\0" for i in ids)
            seen[text] = ids if ids and spelled == text.encode() else None
        ids = seen[text]
        if ids is None:
            continue
        first = ids[0]
        if len(ids) == 1 and _extendable(tables, vocab, s, first):
            continue
        if tables.next_state(s, first) >= 0:
            canon[s] = first
    return canon


def _extendable(tables: TokenTables, vocab: Vocabulary, state: int, token: int) -> bool:
    longer = vocab.extensions(vocab.tokens[token])
    return bool(longer.size) and bool(np.any(tables.class_next[state, tables.token_class[longer]] >= 0))


def forced_jump(tables: TokenTables, canon: np.ndarray, vocab: Vocabulary, state: int) -> Jump | None:
    """Follow canonical tokens from `state`; None when the state has no forced token."""
    tokens, text = [], b""
    while state >= 0 and canon[state] >= 0:
        t = int(canon[state])
        tokens.append(t)
        text += vocab.tokens[t]
        state = tables.next_state(state, t)
    return Jump(tuple(tokens), text, state) if tokens else None
