"""The constrained-decoding libraries behind one interface, for scripts/perf/bench_fsm_peers.py: sgjax.fsm, xgrammar,
llguidance and outlines-core (with and without its token index). Each adapter has compile(kind, spec) -> handle
and session(handle) -> an object with mask(buf) and advance(token); a library that is not installed is skipped by
the caller."""

from __future__ import annotations

import json

import numpy as np

# llguidance's JSON defaults made to match the canonical separators of ours and xgrammar's
LL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Ours:
    def __init__(self, vocab, canonical: bool):
        self.vocab, self.canonical = vocab, canonical
        self.name = "sgjax" if canonical else "sgjax-plain"

    def compile(self, kind, spec):
        from sgjax.fsm import compile_grammar, schema_to_regex

        regex = spec if kind == "regex" else schema_to_regex(spec)
        return compile_grammar(regex, self.vocab, canonical=self.canonical)

    def memory(self, g):
        return {"memory_bytes": int(g.nbytes), "states": int(g.num_states), "classes": int(g.tables.num_classes)}

    def session(self, g):
        return _OurSession(g)


class _OurSession:
    def __init__(self, g):
        self.g, self.state = g, g.start
        self.bits = g.mask_bits

    def mask(self, buf):  # the host path of the engine: copy the state's packed row into the step buffer
        np.copyto(buf, self.bits[self.state])

    def advance(self, token):
        self.state = self.g.next_state(self.state, token)
        return self.state >= 0


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok, vocab_size, eos_id, threads):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab_size, stop_token_ids=[eos_id])
        # cache off: every compile is cold
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)

    def compile(self, kind, spec):
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_json_schema(spec, any_whitespace=False, separators=(", ", ": "), strict_mode=True)

    def memory(self, cg):
        return {"memory_bytes": int(cg.memory_size_bytes)}

    def session(self, cg):
        return _XgrSession(self.xgr.GrammarMatcher(cg))


class _XgrSession:
    def __init__(self, m):
        self.m = m

    def mask(self, buf):
        self.m.fill_next_token_bitmask(buf.reshape(1, -1))

    def advance(self, token):
        return self.m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok, vocab_size, eos_id):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab_size, eos_token=eos_id)

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        grammar = (
            M.grammar_from_regex(spec)
            if kind == "regex"
            else M.grammar_from_json_schema(spec, defaults=LL_JSON_OPTIONS)
        )
        m = M(self.tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar, m

    def memory(self, handle):
        return {}

    def session(self, handle):
        # a fresh matcher per request, as serving does (sglang's llguidance backend builds one per request)
        return _LlgSession(self.llg.LLMatcher(self.tok, handle[0], log_level=0))


class _LlgSession:
    def __init__(self, m):
        import llguidance.numpy

        self.m, self.fill = m, llguidance.numpy.fill_next_token_bitmask

    def mask(self, buf):
        self.fill(self.m, buf.reshape(1, -1))

    def advance(self, token):
        return self.m.consume_token(token)


class Outlines:
    """Guide.write_mask_into (a packed bitmask, what outlines' kernels consume) + Guide.advance."""

    name = "outlines-core"

    def __init__(self, vocab, eos_id):
        import outlines_core

        self.oc, self.eos_id = outlines_core, eos_id
        table = {}
        for i, b in enumerate(vocab.tokens):
            if b is not None:
                table.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos_id, table)

    def compile(self, kind, spec):
        regex = spec if kind == "regex" else self.oc.json_schema.build_regex_from_schema(json.dumps(spec))
        return self.oc.Index(regex, self.vocab)

    def memory(self, index):
        trans = index.get_transitions()
        return {"states": len(trans), "transitions": int(sum(len(v) for v in trans.values()))}

    def session(self, index):
        return _OutlinesSession(self.oc.Guide(index), self.eos_id)


class _OutlinesSession:
    # EOS is in the mask of final states but has no transition (advance raises): it ends the walk there.
    def __init__(self, guide, eos_id):
        self.guide, self.eos_id = guide, eos_id

    def mask(self, buf):
        self.guide.write_mask_into(buf.ctypes.data, buf.size, 4)

    def advance(self, token):
        if token == self.eos_id:
            return self.guide.is_finished()
        try:
            self.guide.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False


class OutlinesIndex(Outlines):
    """The Index API alone: get_allowed_tokens(state) (a list of ids) + get_next_state."""

    name = "outlines-core/index"

    def session(self, index):
        return _OutlinesIndexSession(index, self.eos_id)


class _OutlinesIndexSession:
    def __init__(self, index, eos_id):
        self.index, self.state, self.eos_id = index, index.get_initial_state(), eos_id

    def mask(self, buf):
        self.allowed = self.index.get_allowed_tokens(self.state)

    def advance(self, token):
        if token == self.eos_id:
            return self.index.is_final_state(self.state)
        self.state = self.index.get_next_state(self.state, token)
        return self.state is not None
