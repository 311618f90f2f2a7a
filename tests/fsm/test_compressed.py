"""Compressed FSM: jump strings are exactly the forced bytes; jump-forward equals plain decoding."""

from fsm_helpers import EOS, REGEXES, SETTINGS, TOY, fake_logits
from hypothesis import given

from sgjax.fsm import compile_grammar
from sgjax.fsm.compressed import forced_bytes
from sgjax.fsm.reference import greedy_decode


@SETTINGS
@given(REGEXES)
def test_jump_strings_are_the_forced_bytes(pattern):
    g = compile_grammar(pattern, TOY)
    dfa = g.dfa
    for s in range(dfa.num_states):
        state, text = s, g.jump_text[s]
        for b in text:  # every byte on the chain was the only choice, from a non-accepting state
            assert dfa.out_bytes(state) == [b] and not dfa.accepting[state]
            state = dfa.step(state, bytes([b]))
        assert state == g.jump_dst[s]
        assert dfa.accepting[state] or len(dfa.out_bytes(state)) != 1  # maximal
    forced = forced_bytes(dfa)
    assert all((forced[s] >= 0) == bool(g.jump_text[s]) for s in range(dfa.num_states))


def test_paper_example_chain():
    g = compile_grammar(r'\{"summary": "[a-z]+", "grade": "[AB]"\}', TOY)
    assert g.jump_text[0] == b'{"summary": "'
    jump = g.jump(0)
    assert jump.text == b'{"summary": "' and list(jump.tokens) == TOY.encode('{"summary": "')
    assert g.walk(jump.tokens) == jump.state


def test_last_token_held_back_when_it_could_merge():
    # `"` alone is forced, but `"}` would also be allowed after `a`-free text: hold `"` back.
    g = compile_grammar(r'x"(?:\}|ab)', TOY)
    jump = g.jump(0)
    assert jump.text == b"x" and g.canonical[jump.state] == -1
    assert g.is_allowed(jump.state, TOY.tokens.index(b'"}'))


@SETTINGS
@given(REGEXES)
def test_greedy_same_with_and_without_jump_forward(pattern):
    g = compile_grammar(pattern, TOY)
    model = lambda tokens: fake_logits(tokens, TOY.size)  # noqa: E731
    plain, plain_steps = greedy_decode(g, model, use_jump=False, max_forwards=80)
    jumped, jump_steps = greedy_decode(g, model, use_jump=True, max_forwards=80)
    n = min(len(plain), len(jumped))
    assert plain[:n] == jumped[:n]
    if plain and plain[-1] == EOS:
        assert jumped == plain and jump_steps <= plain_steps
