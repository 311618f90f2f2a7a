"""EBNF grammars (SGLang's `ebnf` sampling parameter, in the GBNF dialect xgrammar and llama.cpp read) -> a regex
in our dialect, so that the compressed FSM runs them like any regex.

    root ::= expr
    expr ::= term (("+" | "-") term)*
    term ::= [0-9]+ | "(" expr ")"      # comments run to the end of the line

Rules are `name ::= alternatives`; the start rule is `root`. Elements: "strings" (and 'strings') with \\n \\t \\r
\\\\ \\" \\xHH \\uHHHH escapes, character classes `[a-z]` / `[^"\\\\]`, rule names, groups `( )`, and `* + ? {m} {m,n}
{m,}`. A context-free grammar is not regular in general: our FSM is, so recursion is bounded as free-form JSON's
nesting is (fsm/json_schema.py): a rule may be entered at most `max_depth` times inside itself, and deeper
derivations are left out. The regex therefore accepts a subset of the grammar's language, never a string outside
it. Errors are `GrammarError`s that say where (the line and column, or the rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sgjax.fsm.errors import GrammarError

MAX_DEPTH = 3  # each level inlines the rules below it again: the regex grows exponentially with it
MAX_REGEX_CHARS = 1 << 20  # past this the expansion is refused rather than handed to the DFA construction
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|\#[^\n]*)
  | (?P<define>::=)
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<repeat>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<op>[|()*+?])
""",
    re.X | re.S,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-", "^": "^"}


@dataclass(frozen=True)
class _Tok:
    kind: str
    text: str
    pos: int


def _where(src: str, pos: int) -> str:
    line = src.count("\n", 0, pos) + 1
    col = pos - (src.rfind("\n", 0, pos) + 1) + 1
    return f"line {line} column {col}"


def _tokens(src: str) -> list[_Tok]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise GrammarError(f"unexpected {src[pos]!r} at {_where(src, pos)}")
        if m.lastgroup != "ws":
            out.append(_Tok(m.lastgroup, m.group(), pos))
        pos = m.end()
    return out


def _unescape(body: str, src: str, pos: int) -> str:
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1] if i + 1 < len(body) else ""
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt in "xu":
            width = 2 if nxt == "x" else 4
            digits = body[i + 2 : i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise GrammarError(f"bad \\{nxt} escape at {_where(src, pos + i)}")
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            raise GrammarError(f"unknown escape \\{nxt} at {_where(src, pos + i)}")
    return "".join(out)


# -- the parse tree: ("alt", [...]) ("seq", [...]) ("lit", text) ("cls", regex) ("ref", name, pos) ("rep", node, lo, hi)
class _Parser:
    def __init__(self, src: str):
        self.src, self.toks, self.i = src, _tokens(src), 0

    def peek(self, k: int = 0) -> _Tok | None:
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def fail(self, message: str):
        tok = self.peek()
        where = _where(self.src, tok.pos) if tok else "the end"
        raise GrammarError(f"{message} at {where}")

    def rules(self) -> dict:
        rules = {}
        while self.peek() is not None:
            name = self.peek()
            if name.kind != "name" or (self.peek(1) is None or self.peek(1).kind != "define"):
                self.fail("expected a rule (name ::= ...)")
            self.i += 2
            if name.text in rules:
                raise GrammarError(f"rule {name.text!r} is defined twice ({_where(self.src, name.pos)})")
            rules[name.text] = self.alternatives()
        return rules

    def alternatives(self):
        options = [self.sequence()]
        while self.peek() is not None and self.peek().text == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def _at_rule_start(self) -> bool:
        nxt = self.peek(1)
        return self.peek().kind == "name" and nxt is not None and nxt.kind == "define"

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek().text not in ("|", ")") and not self._at_rule_start():
            items.append(self.quantified(self.atom()))
        if not items:
            self.fail("expected an element (a string, a class, a rule name or a group)")
        return items[0] if len(items) == 1 else ("seq", items)

    def atom(self):
        tok = self.peek()
        self.i += 1
        if tok.kind == "string":
            return ("lit", _unescape(tok.text[1:-1], self.src, tok.pos + 1))
        if tok.kind == "cls":
            return ("cls", self._cls(tok))
        if tok.kind == "name":
            return ("ref", tok.text, tok.pos)
        if tok.text == "(":
            inner = self.alternatives()
            if self.peek() is None or self.peek().text != ")":
                self.fail("expected ')'")
            self.i += 1
            return inner
        self.i -= 1
        self.fail(f"unexpected {tok.text!r}")

    def _cls(self, tok: _Tok) -> str:
        from sgjax.fsm.regex_parser import RegexError, parse

        body = tok.text[1:-1]
        if body in ("", "^"):
            raise GrammarError(f"empty character class at {_where(self.src, tok.pos)}")
        try:
            parse(tok.text)  # our regex dialect reads the class as GBNF writes it
        except RegexError as e:
            raise GrammarError(f"bad character class {tok.text} at {_where(self.src, tok.pos)}: {e}") from None
        return tok.text

    def quantified(self, node):
        while self.peek() is not None and (self.peek().text in ("*", "+", "?") or self.peek().kind == "repeat"):
            tok = self.peek()
            self.i += 1
            if tok.text == "*":
                node = ("rep", node, 0, None)
            elif tok.text == "+":
                node = ("rep", node, 1, None)
            elif tok.text == "?":
                node = ("rep", node, 0, 1)
            else:
                lo, comma, hi = tok.text[1:-1].replace(" ", "").partition(",")
                lo, hi = int(lo), (int(hi) if hi else None) if comma else int(lo)
                if hi is not None and hi < lo:
                    raise GrammarError(
                        f"repetition {tok.text}: the maximum is below the minimum at {_where(self.src, tok.pos)}"
                    )
                node = ("rep", node, lo, hi)
        return node


def _lit(text: str) -> str:
    return (
        re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    )


class _Expander:
    def __init__(self, src: str, rules: dict, max_depth: int):
        self.src, self.rules, self.max_depth = src, rules, max_depth
        self.size = 0

    def node(self, n, stack: tuple) -> str | None:
        """The regex of a parse-tree node, or None when every derivation of it is deeper than the bound."""
        kind = n[0]
        if kind == "lit":
            return _lit(n[1])
        if kind == "cls":
            return n[1]
        if kind == "ref":
            name = n[1]
            if name not in self.rules:
                raise GrammarError(f"rule {name!r} is not defined ({_where(self.src, n[2])})")
            if stack.count(name) > self.max_depth:
                return None
            out = self.node(self.rules[name], stack + (name,))
            self.size += len(out or "")
            if self.size > MAX_REGEX_CHARS:
                raise GrammarError(
                    f"the grammar expands past {MAX_REGEX_CHARS} regex characters at recursion depth "
                    f"{self.max_depth}; simplify its recursion"
                )
            return None if out is None else f"(?:{out})"
        if kind == "seq":
            parts = [self.node(x, stack) for x in n[1]]
            return None if any(p is None for p in parts) else "".join(parts)
        if kind == "alt":
            parts = [p for p in (self.node(x, stack) for x in n[1]) if p is not None]
            return "(?:" + "|".join(parts) + ")" if parts else None
        _, inner, lo, hi = n
        body = self.node(inner, stack)
        if body is None:
            return "" if lo == 0 else None
        quant = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
        if quant is None:
            quant = f"{{{lo}}}" if hi == lo else f"{{{lo},{'' if hi is None else hi}}}"
        return f"(?:{body}){quant}"


def ebnf_to_regex(src: str, max_depth: int = MAX_DEPTH, root: str = "root") -> str:
    if not isinstance(src, str) or not src.strip():
        raise GrammarError("the grammar is empty")
    rules = _Parser(src).rules()
    if root not in rules:
        raise GrammarError(f"no {root!r} rule (the start rule is named {root!r})")
    out = _Expander(src, rules, max_depth).node(("ref", root, 0), ())
    if out is None:
        raise GrammarError(f"every derivation of {root!r} recurses deeper than {max_depth} levels")
    return out
