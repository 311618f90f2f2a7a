"""Compiled grammars (host side) and the cache that shares them across requests.

A `CompiledGrammar` is immutable and safe to share between threads and requests: per-request
state is a single int (the FSM state), kept by the scheduler.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from sgjax.fsm import budget, completion, compressed
from sgjax.fsm.automaton import ByteDFA, compile_regex
from sgjax.fsm.ebnf import ebnf_to_regex
from sgjax.fsm.errors import GrammarError
from sgjax.fsm.json_schema import JsonOptions, schema_to_regex
from sgjax.fsm.structural_tag import structural_tag_to_regex
from sgjax.fsm.token_fsm import TokenTables, build_token_tables, pack_mask
from sgjax.fsm.vocab import Vocabulary


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """Token FSM of one grammar for one vocabulary. Start state 0; `done` is entered by EOS."""

    key: tuple
    regex: str
    dfa: ByteDFA
    tables: TokenTables
    mask_bits: np.ndarray  # int32[S+1, ceil(V/32)], after the canonical forced-token rule
    canonical: np.ndarray  # int32[S+1], -1 = free mask
    jump_text: tuple[bytes, ...]  # byte-level compressed edge per DFA state
    jump_dst: np.ndarray
    vocab: Vocabulary = field(repr=False)
    compile_seconds: float = 0.0
    _jumps: dict = field(default_factory=dict, repr=False)
    _finish: list = field(default_factory=list, repr=False)  # finish_counts' arrays, once made

    start: int = 0

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def done(self) -> int:
        return self.tables.done

    @property
    def num_states(self) -> int:
        return self.tables.num_states

    @property
    def nbytes(self) -> int:
        t = self.tables
        return t.token_class.nbytes + t.class_next.nbytes + self.mask_bits.nbytes

    def is_allowed(self, state: int, token: int) -> bool:
        return bool((int(self.mask_bits[state, token >> 5]) >> (token & 31)) & 1)

    def allowed_tokens(self, state: int) -> np.ndarray:
        """Ids of the tokens the mask allows in `state`."""
        canon = int(self.canonical[state])
        if canon >= 0:
            return np.array([canon], np.int32)
        row = self.tables.class_next[state] >= 0
        return np.flatnonzero(row[self.tables.token_class]).astype(np.int32)

    def next_state(self, state: int, token: int) -> int:
        """The state after `token`, or -1 if the mask forbids it."""
        return self.tables.next_state(state, token) if self.is_allowed(state, token) else -1

    def is_accepting(self, state: int) -> bool:
        return bool(self.tables.accepting[state])

    def is_finished(self, state: int) -> bool:
        """True when the output is complete: EOS was taken, or an accepting state allows nothing else."""
        if state == self.done:
            return True
        if not self.is_accepting(state) or state >= len(self.jump_text):
            return False
        return not self.dfa.out_bytes(state)

    def jump(self, state: int) -> compressed.Jump | None:
        """Forced tokens from `state` to append in one extend (None: decode normally)."""
        if state not in self._jumps:  # benign race: both threads compute the same value
            self._jumps[state] = compressed.forced_jump(self.tables, self.canonical, self.vocab, state)
        return self._jumps[state]

    def finish_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(per state the fewest tokens to a finished output, per state its successors' largest such count), made
        on first use (fsm/completion.py); RequestBuilder asks on the caller's thread, so the loop never waits."""
        if not self._finish:  # benign race: both threads compute the same arrays
            finished = np.zeros(self.num_states, bool)
            finished[[s for s in range(self.num_states) if self.is_finished(s)]] = True
            dist = completion.tokens_to_finish(self.tables, self.canonical, finished)
            self._finish[:] = [dist, completion.successor_ceiling(self.tables, self.canonical, dist)]
        return self._finish[0], self._finish[1]

    def mask_within(self, state: int, remaining: int) -> np.ndarray:
        """The state's mask for a row with `remaining` tokens left (this one included): the grammar's own while the
        budget cannot bind, else only the tokens after which the output can still finish in time; the grammar's
        own again when nothing can (the request then ends by length: fsm/completion.py)."""
        dist, ceiling = self.finish_counts()
        if remaining - 1 >= ceiling[state]:
            return self.mask_bits[state]
        bits = completion.budget_mask(self.tables, self.mask_bits, self.canonical, dist, state, remaining)
        return bits if bits.any() else self.mask_bits[state]

    def walk(self, tokens, state: int = 0) -> int:
        for t in tokens:
            state = self.next_state(state, int(t))
            if state < 0:
                return -1
        return state


def compile_grammar(regex: str, vocab: Vocabulary, key: tuple | None = None, canonical: bool = True) -> CompiledGrammar:
    """regex -> byte DFA -> token tables + masks + compressed edges.

    canonical=False keeps every byte-valid token in forced states (plain regex masks); jump() then
    returns None, because appending forced tokens would no longer match what decoding emits.
    """
    t0 = time.perf_counter()
    dfa = compile_regex(regex)
    tables = build_token_tables(dfa, vocab)
    text, dst = compressed.jump_strings(dfa)
    if canonical:
        canon = compressed.canonical_tokens(tables, text, vocab)
    else:
        canon = np.full(tables.num_states, -1, np.int32)
    allowed = tables.allowed()
    rows = np.flatnonzero(canon >= 0)
    allowed[rows] = False
    allowed[rows, canon[rows]] = True
    grammar = CompiledGrammar(
        key=key or ("regex", regex, vocab.fingerprint),
        regex=regex,
        dfa=dfa,
        tables=tables,
        mask_bits=pack_mask(allowed),
        canonical=canon,
        jump_text=tuple(text),
        jump_dst=dst,
        vocab=vocab,
        compile_seconds=time.perf_counter() - t0,
    )
    return grammar


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    compile_seconds: float = 0.0


class GrammarCache:
    """LRU of compiled grammars keyed by (kind, grammar text, tokenizer fingerprint, options).

    Shared by all requests: the paper measured 2.4x lower throughput when the FSM is rebuilt per
    request. Concurrent requests for the same missing grammar compile it once; the others wait.
    """

    def __init__(self, max_entries: int = 128, compile_timeout: float | None = None):
        self.max_entries = max_entries
        self.compile_timeout = compile_timeout  # seconds one grammar may take to compile (budget.py); None: any
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        # Grammars that failed to compile, by key (the error): asking again fails at once instead of spending the
        # budget again. Bounded like the entries.
        self._failed: OrderedDict[tuple, GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[tuple, threading.Event] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get_regex(self, regex: str, vocab: Vocabulary, canonical: bool = True) -> CompiledGrammar:
        key = ("regex", regex, vocab.fingerprint, canonical)
        return self._get(key, lambda: compile_grammar(regex, vocab, key, canonical))

    def get_json_schema(self, schema, vocab: Vocabulary, options=None, canonical: bool = True) -> CompiledGrammar:
        options = options or JsonOptions()
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        except RecursionError:
            raise GrammarError("the grammar is nested too deeply") from None
        key = ("json_schema", text, vocab.fingerprint, options, canonical)
        return self._get(key, lambda: compile_grammar(schema_to_regex(schema, options), vocab, key, canonical))

    def get_ebnf(self, grammar: str, vocab: Vocabulary, canonical: bool = True) -> CompiledGrammar:
        key = ("ebnf", grammar, vocab.fingerprint, canonical)
        return self._get(key, lambda: compile_grammar(ebnf_to_regex(grammar), vocab, key, canonical))

    def get_structural_tag(self, spec: str, vocab: Vocabulary, canonical: bool = True) -> CompiledGrammar:
        key = ("structural_tag", spec, vocab.fingerprint, canonical)
        return self._get(key, lambda: compile_grammar(structural_tag_to_regex(spec), vocab, key, canonical))

    def _get(self, key: tuple, build) -> CompiledGrammar:
        while True:
            with self._lock:
                got = self._entries.get(key)
                if got is not None:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    return got
                failed = self._failed.get(key)
                if failed is not None:
                    raise GrammarError(str(failed))
                waiter = self._building.get(key)
                if waiter is None:
                    self._building[key] = threading.Event()
                    self.stats.misses += 1
                    break
            waiter.wait()  # another thread is compiling it; then retry (a failed build raises again here)
        try:
            with budget.deadline(self.compile_timeout):
                grammar = build()
        except RecursionError:
            error = GrammarError("the grammar is nested too deeply")
            self._fail(key, error)
            raise error from None
        except GrammarError as e:
            self._fail(key, e)
            raise
        except BaseException:
            with self._lock:
                self._building.pop(key).set()
            raise
        with self._lock:
            self._entries[key] = grammar
            self.stats.compile_seconds += grammar.compile_seconds
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.stats.evictions += 1
            self._building.pop(key).set()
        return grammar

    def _fail(self, key: tuple, error: GrammarError) -> None:
        with self._lock:
            self._failed[key] = error
            while len(self._failed) > self.max_entries:
                self._failed.popitem(last=False)
            self._building.pop(key).set()


__all__ = ["CompiledGrammar", "GrammarCache", "GrammarError", "compile_grammar"]
