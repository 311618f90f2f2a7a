"""Token tables against the byte DFA, and the sampling property from the issue."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from fsm_helpers import EOS, REGEXES, SETTINGS, SPECIAL, TOY, decode
from hypothesis import given
from hypothesis import strategies as st

from sgjax.fsm import advance, apply_mask, compile_grammar, pack_tables


@SETTINGS
@given(REGEXES)
def test_token_transitions_equal_byte_walks(pattern):
    g = compile_grammar(pattern, TOY, canonical=False)
    t = g.tables
    for s in range(g.dfa.num_states):
        for tok, data in enumerate(TOY.tokens):
            want = -1 if data is None else g.dfa.step(s, data)
            if tok == EOS:
                want = g.done if g.dfa.accepting[s] else -1
            assert t.next_state(s, tok) == want, (pattern, s, data)
            assert g.is_allowed(s, tok) == (want >= 0)
    assert t.next_state(g.done, EOS) == g.done and g.allowed_tokens(g.done).tolist() == [EOS]


def test_partial_utf8_tokens():
    g = compile_grammar("é+", TOY, canonical=False)
    half = TOY.tokens.index(b"\xc3")
    mid = g.next_state(0, half)
    assert mid >= 0 and not g.is_accepting(mid) and not g.is_allowed(mid, EOS)
    assert g.is_accepting(g.next_state(mid, TOY.tokens.index(b"\xa9")))
    assert g.next_state(mid, TOY.tokens.index(b"\xa9a")) == -1
    assert not g.is_allowed(0, SPECIAL)


@jax.jit
def _step(tables, states, logits, key):
    masked = apply_mask(logits, tables, states)
    tokens = jax.random.categorical(key, masked).astype(jnp.int32)  # temperature 1
    return tokens, advance(tables, states, tokens)


@SETTINGS
@given(st.lists(REGEXES, min_size=2, max_size=2), st.integers(0, 2**31))
def test_sampling_with_device_masks_matches_regex(patterns, seed):
    grammars = [compile_grammar(p, TOY) for p in patterns]
    # Fixed capacities: one trace serves every example (the engine pads the same way).
    tables, offsets = pack_tables(grammars, TOY.size, state_capacity=1024, class_capacity=384, grammar_capacity=4)
    rows = 6  # rows 0-2 follow grammar 0, 3-4 grammar 1, row 5 is unconstrained (FREE)
    which = [0, 0, 0, 1, 1, None]
    states = np.array([0 if w is None else offsets[w] for w in which], np.int32)
    key = jax.random.PRNGKey(seed)
    rng = np.random.default_rng(seed)
    outputs = [[] for _ in range(rows)]
    finished = [False] * rows
    for _ in range(48):
        logits = rng.normal(size=(rows, TOY.size)).astype(np.float32) * 3
        logits[:, EOS] += 2.0  # make finishing likely within the step budget
        key, sub = jax.random.split(key)
        tokens, new_states = jax.device_get(_step(tables, jnp.asarray(states), jnp.asarray(logits), sub))
        for r, w in enumerate(which):
            if finished[r] or w is None:
                continue
            g, local = grammars[w], int(states[r]) - offsets[w]
            assert g.is_allowed(local, int(tokens[r])), (patterns[w], local, tokens[r])
            assert int(new_states[r]) - offsets[w] == g.next_state(local, int(tokens[r]))
            outputs[r].append(int(tokens[r]))
            finished[r] = int(tokens[r]) == EOS
        assert new_states[5] == 0
        states = np.asarray(new_states)
    for r, w in enumerate(which):
        if w is not None and finished[r]:
            assert re.fullmatch(patterns[w], decode(TOY, outputs[r]).decode(), re.ASCII), (patterns[w], outputs[r])
    assert any(finished[:5])
