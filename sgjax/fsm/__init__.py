"""Constrained decoding: regex / JSON schema -> token FSM tables, compressed FSM, device masks.

Layers (docs/fsm.md): regex_parser (dialect) -> automaton (byte DFA) -> token_fsm (token tables)
-> compressed (jump strings, canonical forced tokens) -> grammar (compiled grammar + cache)
-> device (arena of tables, pure mask/advance functions for the jitted sampler).
"""

from sgjax.fsm.automaton import ByteDFA, compile_regex
from sgjax.fsm.compressed import Jump
from sgjax.fsm.device import DeviceTables, advance, allowed_mask, apply_bitmask, apply_mask, pack_tables
from sgjax.fsm.errors import GrammarError
from sgjax.fsm.grammar import CompiledGrammar, GrammarCache, compile_grammar
from sgjax.fsm.json_schema import JsonOptions, schema_to_regex
from sgjax.fsm.regex_parser import RegexError
from sgjax.fsm.vocab import Vocabulary, from_hf_tokenizer, from_tokenizer, load_vocabulary

__all__ = [
    "ByteDFA",
    "CompiledGrammar",
    "DeviceTables",
    "GrammarCache",
    "GrammarError",
    "JsonOptions",
    "Jump",
    "RegexError",
    "Vocabulary",
    "advance",
    "allowed_mask",
    "apply_bitmask",
    "apply_mask",
    "compile_grammar",
    "compile_regex",
    "from_hf_tokenizer",
    "from_tokenizer",
    "load_vocabulary",
    "pack_tables",
    "schema_to_regex",
]
