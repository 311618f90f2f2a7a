"""Regex AST -> byte-level NFA -> minimized DFA over bytes 0..255.

Working on bytes (not characters) is what lets a token that ends in the middle of a UTF-8
sequence be judged correctly: the tokenizer's vocabulary is bytes, so the automaton must be too.
Transitions are stored over byte equivalence classes (bytes no edge of the regex tells apart),
which keeps the DFA tables small and lets the token walk run on class sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgjax.fsm import budget
from sgjax.fsm.errors import GrammarError
from sgjax.fsm.regex_parser import Alt, CharSet, Concat, Repeat, parse

MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 50_000
_UTF8_MAX = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)


@dataclass(frozen=True)
class ByteDFA:
    """Minimized, trimmed DFA: state 0 is the start; -1 means dead (no accepting state reachable).

    `trans[s, byte_class[b]]` is the successor of state s on byte b. Every state can still reach an
    accepting state, so "the walk is not -1" is exactly "the bytes so far are a prefix of a match".
    """

    byte_class: np.ndarray  # int32[256]
    trans: np.ndarray  # int32[S, K]
    accepting: np.ndarray  # bool[S]

    @property
    def num_states(self) -> int:
        return self.trans.shape[0]

    def step(self, state: int, data: bytes) -> int:
        for b in data:
            if state < 0:
                return -1
            state = int(self.trans[state, self.byte_class[b]])
        return state

    def accepts(self, data: bytes) -> bool:
        s = self.step(0, data)
        return s >= 0 and bool(self.accepting[s])

    def out_bytes(self, state: int) -> list[int]:
        """The bytes with a live transition out of `state`."""
        live = self.trans[state][self.byte_class] >= 0
        return np.flatnonzero(live).tolist()


def compile_regex(pattern: str) -> ByteDFA:
    return build_dfa(parse(pattern))


# --- UTF-8 ------------------------------------------------------------------------------------
def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Split a code point range into byte-range sequences whose product is exactly its UTF-8 set."""
    out, stack = [], [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        split = False
        for bound in _UTF8_MAX[:-1]:
            if lo <= bound < hi:
                stack += [(bound + 1, hi), (lo, bound)]
                split = True
                break
        if split:
            continue
        n = next(i + 1 for i, m in enumerate(_UTF8_MAX) if hi <= m)
        for i in range(1, n):
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    stack += [((lo | m) + 1, hi), (lo, lo | m)]
                    split = True
                    break
                if hi & m != m:
                    stack += [(hi & ~m, hi), (lo, (hi & ~m) - 1)]
                    split = True
                    break
        if not split:
            a, b = chr(lo).encode(), chr(hi).encode()
            out.append(list(zip(a, b)))
    return out


# --- NFA (Thompson) ---------------------------------------------------------------------------
class _NFA:
    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []  # (byte lo, byte hi, dst)

    def new(self) -> int:
        if len(self.eps) % 4096 == 0:
            budget.check()
        if len(self.eps) >= MAX_NFA_STATES:
            raise GrammarError(f"regex too large: more than {MAX_NFA_STATES} NFA states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node, start: int) -> int:
        """Add `node` starting at `start`; return its end state."""
        if isinstance(node, CharSet):
            end = self.new()
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = start
                    for k, (a, b) in enumerate(seq):
                        nxt = end if k == len(seq) - 1 else self.new()
                        self.edges[cur].append((a, b, nxt))
                        cur = nxt
            return end
        if isinstance(node, Concat):
            cur = start
            for item in node.items:
                cur = self.build(item, cur)
            return cur
        if isinstance(node, Alt):
            end = self.new()
            for item in node.items:
                s = self.new()
                self.eps[start].append(s)
                self.eps[self.build(item, s)].append(end)
            return end
        if isinstance(node, Repeat):
            cur = start
            for _ in range(node.lo):
                cur = self.build(node.item, cur)
            if node.hi is None:
                loop = self.new()
                self.eps[cur].append(loop)
                self.eps[self.build(node.item, loop)].append(loop)
                return loop
            end = self.new()
            for _ in range(node.hi - node.lo):
                self.eps[cur].append(end)
                cur = self.build(node.item, cur)
            self.eps[cur].append(end)
            return end
        raise TypeError(f"unknown regex node {node!r}")


def build_dfa(ast) -> ByteDFA:
    nfa = _NFA()
    start = nfa.new()
    final = nfa.build(ast, start)
    byte_class = _byte_classes(nfa)
    trans, accepting = _determinize(nfa, start, final, byte_class)
    return _trim(*_minimize(trans, accepting), byte_class)


def _byte_classes(nfa: _NFA) -> np.ndarray:
    cuts = np.zeros(257, dtype=bool)
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts[lo] = cuts[hi + 1] = True
    cuts[0] = False
    return np.cumsum(cuts[:256]).astype(np.int32)


def _determinize(nfa: _NFA, start: int, final: int, byte_class: np.ndarray):
    closures: dict[int, frozenset] = {}

    def closure(s: int) -> frozenset:
        got = closures.get(s)
        if got is None:
            seen, stack = {s}, [s]
            while stack:
                for t in nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            got = closures[s] = frozenset(seen)
        return got

    class_edges = [[(int(byte_class[lo]), int(byte_class[hi]), dst) for lo, hi, dst in e] for e in nfa.edges]
    k = int(byte_class[-1]) + 1
    first = closure(start)
    index, order, rows = {first: 0}, [first], []
    while len(rows) < len(order):
        budget.check()
        current = order[len(rows)]
        targets: dict[int, set] = {}
        for s in current:
            for clo, chi, dst in class_edges[s]:
                for c in range(clo, chi + 1):
                    targets.setdefault(c, set()).update(closure(dst))
        row = [-1] * k
        for c, tset in targets.items():
            key = frozenset(tset)
            if key not in index:
                if len(order) >= MAX_DFA_STATES:
                    raise GrammarError(f"regex too large: more than {MAX_DFA_STATES} DFA states")
                index[key] = len(order)
                order.append(key)
            row[c] = index[key]
        rows.append(row)
    trans = np.array(rows, dtype=np.int32).reshape(len(rows), k)
    accepting = np.array([final in s for s in order], dtype=bool)
    return trans, accepting


def _minimize(trans: np.ndarray, accepting: np.ndarray):
    """Moore partition refinement, vectorized: split blocks until successor signatures agree."""
    n = trans.shape[0]
    full = np.concatenate([trans, np.full((1, trans.shape[1]), n, np.int32)])  # row n = dead sink
    full[full < 0] = n
    block = np.concatenate([accepting.astype(np.int64), [2]])  # the sink is its own block
    count = len(np.unique(block))
    while True:
        budget.check()
        sig = np.concatenate([block[:, None], block[full]], axis=1)
        _, block = np.unique(sig, axis=0, return_inverse=True)
        block = block.reshape(-1)
        new_count = int(block.max()) + 1
        if new_count == count:
            break
        count = new_count
    sink = block[n]
    reps = np.zeros(count, dtype=np.int64)
    reps[block[::-1]] = np.arange(n, -1, -1)  # a representative state of each block
    mtrans = block[full[reps]]
    mtrans[mtrans == sink] = -1
    macc = np.zeros(count, dtype=bool)
    macc[block[:n]] = accepting
    mtrans[sink] = -1
    return mtrans, macc, int(block[0]), sink


def _trim(trans: np.ndarray, accepting: np.ndarray, start: int, sink: int, byte_class: np.ndarray) -> ByteDFA:
    """Keep states reachable from start that can reach acceptance; renumber in BFS order from 0."""
    n = trans.shape[0]
    alive = accepting.copy()
    while True:
        succ_alive = np.zeros(n, dtype=bool)
        has = trans >= 0
        succ_alive[np.any(has & alive[np.where(has, trans, 0)], axis=1)] = True
        grown = alive | succ_alive
        grown[sink] = False
        if np.array_equal(grown, alive):
            break
        alive = grown
    if not alive[start]:
        raise GrammarError("the regex matches no string")
    order, index = [start], {start: 0}
    for s in order:
        for t in trans[s]:
            t = int(t)
            if t >= 0 and alive[t] and t not in index:
                index[t] = len(order)
                order.append(t)
    remap = np.full(n + 1, -1, dtype=np.int32)
    remap[order] = np.arange(len(order), dtype=np.int32)
    sub = trans[order]
    sub = np.where(sub >= 0, remap[np.where(sub >= 0, sub, n)], -1).astype(np.int32)
    return ByteDFA(byte_class=byte_class, trans=sub, accepting=accepting[order].copy())
