"""EBNF -> regex (fsm/ebnf.py): random walks through the compiled DFA of a few grammars produce strings that a
reference parser (lark, Earley) accepts for the same grammar written in its syntax; bounded recursion keeps the
language a subset; bad grammars fail with a GrammarError that says where."""

import random

import pytest
from lark import Lark
from lark.exceptions import LarkError

from sgjax.fsm.automaton import GrammarError, compile_regex
from sgjax.fsm.ebnf import ebnf_to_regex

GRAMMARS = {
    "arithmetic": (r'''
        root ::= expr
        expr ::= term (("+" | "-") term)*   # left-associative sums
        term ::= [0-9]{1,3} | "(" expr ")"
    ''', r'''
        start: expr
        expr: term (("+" | "-") term)*
        term: /[0-9]{1,3}/ | "(" expr ")"
    '''),
    "json-ish": (r'''
        root ::= value
        value ::= array | string | number | "true" | "null"
        array ::= "[" (value ("," " "? value)*)? "]"
        string ::= "\"" [a-z ]* "\""
        number ::= "-"? [1-9] [0-9]*
    ''', r'''
        start: value
        value: array | STRING | NUMBER | "true" | "null"
        array: "[" (value ("," SP? value)*)? "]"
        SP: " "
        STRING: /"[a-z ]*"/
        NUMBER: /-?[1-9][0-9]*/
    '''),
    "commands": (r'''
        root ::= cmd ("\n" cmd){0,2}
        cmd ::= "set " key "=" val | "del " key | '# ' [^\n]{0,10}
        key ::= [a-z_]{1,8}
        val ::= "'" [^'\\\n]* "'" | [0-9]+
    ''', r'''
        start: cmd ("\n" cmd)~0..2
        cmd: "set " KEY "=" VAL | "del " KEY | COMMENT
        KEY: /[a-z_]{1,8}/
        VAL: /'[^'\\\n]*'/ | /[0-9]+/
        COMMENT: /# [^\n]{0,10}/
    '''),
}


def _walk(dfa, rng: random.Random, stop: float = 0.15, limit: int = 200) -> bytes:
    state, out = 0, bytearray()
    while True:
        nxt = dfa.out_bytes(state)
        if dfa.accepting[state] and (not nxt or rng.random() < stop or len(out) >= limit):
            return bytes(out)
        b = rng.choice(nxt)
        out.append(b)
        state = dfa.step(state, bytes([b]))
        assert state >= 0


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_random_walks_are_in_the_reference_language(name):
    ebnf, lark_src = GRAMMARS[name]
    dfa = compile_regex(ebnf_to_regex(ebnf))
    ref = Lark(lark_src, parser="earley", lexer="dynamic")
    rng = random.Random(0)
    walks = {_walk(dfa, rng).decode("utf-8") for _ in range(300)}
    assert len(walks) > 30  # the walks explore the grammar, not one string
    for text in walks:
        ref.parse(text)  # raises when the string is outside the grammar


def test_recursion_is_bounded_to_a_subset():
    ebnf, lark_src = GRAMMARS["arithmetic"]
    ref = Lark(lark_src, parser="earley", lexer="dynamic")
    shallow = compile_regex(ebnf_to_regex(ebnf, max_depth=1))
    deep = "((((1))))"
    ref.parse(deep)
    assert shallow.accepts(b"(1)+2") and not shallow.accepts(deep.encode())
    assert compile_regex(ebnf_to_regex(ebnf, max_depth=4)).accepts(deep.encode())
    for bad in ["1+", "(1", "1234", "+"]:
        assert not compile_regex(ebnf_to_regex(ebnf)).accepts(bad.encode())
        with pytest.raises(LarkError):
            ref.parse(bad)


@pytest.mark.parametrize("src, message", [
    ("", "empty"),
    ("root ::= ", "expected an element"),
    ("root ::= word", "rule 'word' is not defined (line 1 column 10)"),
    ("start ::= 'a'", "no 'root' rule"),
    ("root ::= 'a'\nroot ::= 'b'", "defined twice"),
    ("root ::= 'a' {3,1}", "maximum is below the minimum"),
    ("root ::= root 'a'", "recurses deeper"),
    ("root ::= 'a\\q'", "unknown escape"),
    ("root ::= ('a' | 'b'", "expected ')'"),
    ("root ::= 'a' @", "unexpected '@' at line 1 column 14"),
])
def test_bad_grammars_say_where(src, message):
    with pytest.raises(GrammarError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ebnf_to_regex(src)
