"""Device tables: masks and transitions equal the host tables; fixed capacities avoid retracing."""

import jax
import jax.numpy as jnp
import numpy as np
from fsm_helpers import TOY

from sgjax.fsm import advance, allowed_mask, apply_bitmask, compile_grammar, pack_tables
from sgjax.fsm.token_fsm import pack_mask, unpack_mask


def test_arena_matches_host_tables():
    grammars = [compile_grammar(r"[ab]+c?", TOY), compile_grammar(r'\{"a": [0-9]{1,3}\}', TOY)]
    tables, offsets = pack_tables(grammars, TOY.size)
    states = np.arange(tables.num_states, dtype=np.int32)
    mask = np.asarray(allowed_mask(tables, jnp.asarray(states)))
    assert mask[0].all()  # FREE
    for g, off in zip(grammars, offsets):
        for s in range(g.num_states):
            assert np.array_equal(np.flatnonzero(mask[off + s]), g.allowed_tokens(s))
            toks = g.allowed_tokens(s)
            nxt = np.asarray(advance(tables, jnp.full(toks.shape, off + s, jnp.int32), jnp.asarray(toks)))
            assert [int(n) - off for n in nxt] == [g.next_state(s, int(t)) for t in toks]


def test_bitmask_roundtrip_and_apply():
    rng = np.random.default_rng(1)
    allowed = rng.random((3, 77)) < 0.3
    bits = pack_mask(allowed)
    assert bits.dtype == np.int32 and bits.shape == (3, 3)
    assert np.array_equal(unpack_mask(bits, 77), allowed)
    out = np.asarray(apply_bitmask(jnp.zeros((3, 77)), jnp.asarray(bits)))
    assert np.array_equal(np.isfinite(out), allowed)


def test_no_retrace_across_grammars():
    traces = []

    @jax.jit
    def step(tables, states, tokens):
        traces.append(1)
        return advance(tables, states, tokens), allowed_mask(tables, states)

    caps = dict(state_capacity=256, class_capacity=300, grammar_capacity=4)
    for pattern in ("a+", "(?:xy|z)*q", "[0-9]{2,4}"):
        tables, offsets = pack_tables([compile_grammar(pattern, TOY)], TOY.size, **caps)
        step(tables, jnp.array([offsets[0], 0], jnp.int32), jnp.array([5, 6], jnp.int32))
    assert len(traces) == 1
