"""Parser + byte DFA against Python's re (with re.ASCII: our \\d \\w \\s are ASCII)."""

import re

import numpy as np
import pytest
from fsm_helpers import ALPHABET, REGEXES, SETTINGS, random_match
from hypothesis import given
from hypothesis import strategies as st

from sgjax.fsm.automaton import compile_regex, utf8_sequences
from sgjax.fsm.regex_parser import RegexError


@SETTINGS
@given(
    REGEXES,
    st.lists(st.text(alphabet=ALPHABET + "x\n\t0", max_size=8), min_size=20, max_size=20),
    st.integers(0, 2**31),
)
def test_dfa_agrees_with_python_re(pattern, strings, seed):
    dfa = compile_regex(pattern)
    rx = re.compile(pattern, re.ASCII)
    for s in strings:
        assert dfa.accepts(s.encode()) == bool(rx.fullmatch(s)), (pattern, s)
    rng = np.random.default_rng(seed)
    for _ in range(10):
        m = random_match(dfa, rng)
        if m is not None:
            assert rx.fullmatch(m.decode()), (pattern, m)


def test_minimized_and_trimmed():
    dfa = compile_regex("(?:a|a)(?:bb|b{2})c*")
    assert dfa.num_states == 4  # start, after a, after b, after bb (accepting, c loop)
    assert dfa.step(0, b"x") == -1 and dfa.step(0, b"ab") >= 0


@pytest.mark.parametrize(
    "pattern,pos",
    [
        ("a(b", 1),
        ("a)b", 1),
        ("*a", 0),
        ("a**", 2),
        ("[b-a]", 2),
        (r"a\1", 1),
        ("(?=a)", 0),
        ("a^b", 1),
        ("[abc", 0),
        (r"\p{L}", 0),
    ],
)
def test_errors_name_the_position(pattern, pos):
    with pytest.raises(RegexError) as err:
        compile_regex(pattern)
    assert err.value.pos == pos and f"position {pos}" in str(err.value)


def test_unicode_and_classes():
    dfa = compile_regex("[^a]é.")
    assert dfa.accepts("bé中".encode()) and not dfa.accepts("aéx".encode()) and not dfa.accepts("xé\n".encode())
    assert compile_regex(r"\w+").accepts(b"ab_9") and not compile_regex(r"\w").accepts("é".encode())
    assert compile_regex("^ab$").accepts(b"ab") and compile_regex("a{,2}").accepts(b"aa")
    assert compile_regex("a{x}").accepts(b"a{x}")  # not a repeat: literal braces, as in Python


@SETTINGS
@given(st.booleans(), st.integers(0, 0xD7FF), st.integers(0, 0xD7FF))
def test_utf8_sequences_cover_exactly_the_range(high, a, b):
    # Ranges never contain surrogates (the parser removes them), so test both sides of the gap.
    lo, hi = sorted((a, b))
    if high:
        lo, hi = 0x10FFFF - hi, 0x10FFFF - lo
        lo, hi = max(lo, 0xE000), max(hi, 0xE000)
    seqs = utf8_sequences(lo, hi)
    probes = {lo, hi, (lo + hi) // 2, max(lo - 1, 0), min(hi + 1, 0x10FFFF), 0x7F, 0x80, 0x7FF, 0x800, 0xFFFF}
    for cp in probes:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        enc = chr(cp).encode()
        hit = any(len(s) == len(enc) and all(x <= byte <= y for byte, (x, y) in zip(enc, s)) for s in seqs)
        assert hit == (lo <= cp <= hi), hex(cp)
