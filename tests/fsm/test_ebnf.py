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
    "arithmetic": (
        r"""
        root ::= expr
        expr ::= term (("+" | "-") term)*   # left-associative sums
        term ::= [0-9]{1,3} | "(" expr ")"
    """,
        r"""
        start: expr
        expr: term (("+" | "-") term)*
        term: /[0-9]{1,3}/ | "(" expr ")"
    """,
    ),
    "json-ish": (
        r"""
        root ::= value
        value ::= array | string | number | "true" | "null"
        array ::= "[" (value ("," " "? value)*)? "]"
        string ::= "\"" [a-z ]* "\""
        number ::= "-"? [1-9] [0-9]*
    """,
        r"""
        start: value
        value: array | STRING | NUMBER | "true" | "null"
        array: "[" (value ("," SP? value)*)? "]"
        SP: " "
        STRING: /"[a-z ]*"/
        NUMBER: /-?[1-9][0-9]*/
    """,
    ),
    "commands": (
        r"""
        root ::= cmd ("\n" cmd){0,2}
        cmd ::= "set " key "=" val | "del " key | '# ' [^\n]{0,10}
        key ::= [a-z_]{1,8}
        val ::= "'" [^'\\\n]* "'" | [0-9]+
    """,
        r"""
        start: cmd ("\n" cmd)~0..2
        cmd: "set " KEY "=" VAL | "del " KEY | COMMENT
        KEY: /[a-z_]{1,8}/
        VAL: /'[^'\\\n]*'/ | /[0-9]+/
        COMMENT: /# [^\n]{0,10}/
    """,
    ),
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


@pytest.mark.parametrize(
    "src, message",
    [
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
    ],
)
def test_bad_grammars_say_where(src, message):
    with pytest.raises(GrammarError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ebnf_to_regex(src)


# -- structural tags (fsm/structural_tag.py) ------------------------------------------------------------------
@pytest.mark.parametrize("trigger", ["<tool_call>", "[TOOL_CALLS]", "<f=", "x"])
def test_without_trigger_is_exactly_the_strings_without_it(trigger):
    import itertools

    from sgjax.fsm.structural_tag import without

    dfa = compile_regex(without(trigger))
    alphabet = sorted(set(trigger[:3])) + ["z"]
    rng = random.Random(1)
    texts = ["".join(t) for n in range(5) for t in itertools.product(alphabet, repeat=n)]
    texts += ["".join(rng.choices(sorted(set(trigger)) + ["z"], k=rng.randint(5, 30))) for _ in range(500)]
    texts += [trigger, "ab" + trigger[:-1], trigger[0] * 3 + trigger]
    for text in texts:
        assert dfa.accepts(text.encode()) == (trigger not in text), text


def test_structural_tag():
    import json

    from sgjax.fsm.structural_tag import structural_tag_to_regex

    spec = {
        "structures": [
            {
                "begin": "<f=add>",
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                "end": "</f>",
            }
        ],
        "triggers": ["<f="],
    }
    dfa = compile_regex(structural_tag_to_regex(json.dumps(spec)))
    for ok in ["plain text", 'x <f=add>{"a": 1}</f> and <f=add>{"a": 2}</f>.', "<f"]:
        assert dfa.accepts(ok.encode()), ok
    for bad in ['<f=sub>{"a": 1}</f>', '<f=add>{"a": "x"}</f>', "<f=add>"]:
        assert not dfa.accepts(bad.encode()), bad
    for broken, message in [
        ({"structures": [], "triggers": ["<"]}, "structures"),
        ({**spec, "triggers": ["<a", "<b"]}, "exactly one trigger"),
        ({**spec, "triggers": ["<g="]}, "must start with the trigger"),
        ({**spec, "triggers": ["<f<"]}, "occurs again"),
    ]:
        with pytest.raises(GrammarError, match=message):
            structural_tag_to_regex(broken)
