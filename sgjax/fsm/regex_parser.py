"""Regex -> AST over Unicode code points (the dialect is documented in docs/fsm.md).

The pattern always describes a full match; there are no anchors, look-arounds or back-references
because none of them is regular at the token level we need. Anything outside the dialect raises
`RegexError` with the offending position instead of being silently reinterpreted.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # not encodable in UTF-8, so never part of a class


class RegexError(ValueError):
    """A pattern outside the supported dialect; `pos` is the 0-based offset in the pattern."""

    def __init__(self, message: str, pattern: str, pos: int):
        super().__init__(f"{message} at position {pos} in regex {pattern!r}")
        self.pattern = pattern
        self.pos = pos


# --- AST -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CharSet:
    """A set of code points as sorted, disjoint, non-adjacent inclusive ranges."""

    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Concat:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Repeat:
    item: object
    lo: int
    hi: int | None  # None = unbounded


EMPTY = Concat(())


def normalize(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def complement(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for lo, hi in normalize(list(ranges) + [_SURROGATES]):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


def without_surrogates(ranges) -> tuple[tuple[int, int], ...]:
    return complement(complement(ranges))


# ASCII classes on purpose: Unicode \w depends on the Unicode tables of whoever compiled the
# grammar, and JSON/regex users almost always mean ASCII. Python equivalent: re.ASCII.
DIGIT = ((0x30, 0x39),)
WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = normalize([(0x09, 0x0D), (0x20, 0x20)])
_CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07, "0": 0x00}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_REPEAT_LIMIT = 1000


def parse(pattern: str):
    """Parse `pattern` into an AST of CharSet / Concat / Alt / Repeat."""
    return _Parser(pattern).parse()


class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def error(self, message: str, pos: int | None = None):
        raise RegexError(message, self.p, self.i if pos is None else pos)

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.p[j] if j < len(self.p) else None

    def parse(self):
        # A leading ^ / trailing $ restate the implicit full match; allow them for pasted patterns.
        if self.p.startswith("^"):
            self.i = 1
        end = len(self.p)
        if self.p.endswith("$") and not self.p.endswith("\\$"):
            self.p, end = self.p[:-1], end - 1
        node = self.alternation()
        if self.i < end:
            self.error("unbalanced ')'" if self.peek() == ")" else "unexpected character")
        return node

    def alternation(self):
        items = [self.concat()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.concat())
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def concat(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self, node):
        quantified_once = False
        while True:
            c, start = self.peek(), self.i
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (bounds := self.braces()) is not None:
                lo, hi = bounds
            else:
                return node
            if quantified_once:
                self.error("multiple repeat", start)
            quantified_once = True
            if self.peek() == "?":  # lazy: same language under full match
                self.i += 1
            elif self.peek() == "+":
                self.error("possessive quantifiers are not supported")
            node = Repeat(node, lo, hi)

    def braces(self):
        """Parse {m}, {m,}, {m,n} or {,n}; None (and no advance) when it is a literal '{' as in Python."""
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1 : j]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and lo_s == "")) or not (hi_s.isdigit() or hi_s == ""):
            return None
        if not lo_s and not hi_s and comma:
            return None
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            self.error("min repeat greater than max repeat")
        if max(lo, hi or 0) > _REPEAT_LIMIT:
            self.error(f"repeat count above {_REPEAT_LIMIT}")
        self.i = j + 1
        return lo, hi

    def atom(self):
        c, start = self.peek(), self.i
        if c == "(":
            self.i += 1
            if self.peek() == "?":
                if self.p.startswith("?:", self.i):
                    self.i += 2
                elif self.p.startswith("?P<", self.i):
                    close = self.p.find(">", self.i)
                    if close < 0 or not self.p[self.i + 3 : close].isidentifier():
                        self.error("bad group name")
                    self.i = close + 1
                else:
                    self.error("unsupported group construct (look-around, flags, ...)", start)
            node = self.alternation()
            if self.peek() != ")":
                self.error("missing ')'", start)
            self.i += 1
            return node
        if c in ("*", "+", "?"):
            self.error("nothing to repeat")
        if c in ("^", "$"):
            self.error("anchors are only allowed at the very start/end (the match is always full)")
        self.i += 1
        if c == "[":
            return CharSet(self.char_class(start))
        if c == ".":
            return CharSet(complement([(0x0A, 0x0A)]))
        if c == "\\":
            got = self.escape(in_class=False)
            return CharSet(got if isinstance(got, tuple) else ((got, got),))
        return CharSet(((ord(c), ord(c)),)) if not 0xD800 <= ord(c) <= 0xDFFF else self.error("surrogate")

    def escape(self, in_class: bool):
        """After a backslash: a code point (int) or a class (ranges tuple)."""
        start = self.i - 1
        c = self.peek()
        if c is None:
            self.error("trailing backslash", start)
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[c.lower()]
            return complement(ranges) if c.isupper() else ranges
        if c in _CHAR_ESCAPES:
            if c == "0" and self.peek() is not None and self.peek().isdigit():
                self.error("octal escapes are not supported", start)
            return _CHAR_ESCAPES[c]
        if c in _HEX_ESCAPES:
            n = _HEX_ESCAPES[c]
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.error(f"bad \\{c} escape", start)
            self.i += n
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or 0xD800 <= cp <= 0xDFFF:
                self.error("escape is not a Unicode scalar value", start)
            return cp
        if c == "b" and in_class:
            return 0x08
        if c.isalnum():
            self.error(f"unsupported escape \\{c}", start)
        return ord(c)

    def char_class(self, start: int) -> tuple[tuple[int, int], ...]:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                self.error("unterminated character class", start)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if isinstance(lo, tuple):
                ranges.extend(lo)
                continue
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                dash = self.i
                self.i += 1
                hi = self.class_item()
                if isinstance(hi, tuple):
                    self.error("bad character range", dash)
                if hi < lo:
                    self.error("bad character range", dash)
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        ranges_n = without_surrogates(ranges)
        return complement(ranges_n) if negate else ranges_n

    def class_item(self):
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[" and self.peek() == ":":
            self.error("POSIX classes are not supported")
        return ord(c)
