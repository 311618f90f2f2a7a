"""SmolLM2's real 49k vocabulary: compile time, canonical tokenization, jump-forward, the cache."""

import json
import threading
import time

import jsonschema
import numpy as np
from fsm_helpers import decode, fake_logits

from sgjax.fsm import GrammarCache
from sgjax.fsm.reference import greedy_decode

PAPER = r'\{"summary": "[\w\d\s]+\.", "grade": "[ABCD][+-]?"\}'
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 20},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
    },
    "required": ["id", "name", "role", "active", "score", "tags", "address"],
}
INSTANCE = {
    "id": 12,
    "name": "Bob",
    "role": "admin",
    "active": True,
    "score": 1.5,
    "tags": ["a", "b"],
    "address": {"street": "Main St", "city": "Paris", "zip": "75001"},
}
CACHE = GrammarCache()


def test_compile_is_fast_and_cached(smollm2_vocab):
    t0 = time.perf_counter()
    g = CACHE.get_json_schema(SCHEMA, smollm2_vocab)
    assert time.perf_counter() - t0 < 5.0  # ~1 s here; the budget leaves room for a loaded machine
    assert CACHE.get_json_schema(dict(reversed(list(SCHEMA.items()))), smollm2_vocab) is g  # key order-free
    assert CACHE.stats.hits >= 1 and CACHE.stats.misses >= 1


def test_cache_compiles_once_under_concurrency(smollm2_vocab):
    cache, got = GrammarCache(max_entries=2), []
    threads = [threading.Thread(target=lambda: got.append(cache.get_regex(PAPER, smollm2_vocab))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.stats.misses == 1 and cache.stats.hits == 3 and all(g is got[0] for g in got)


def test_canonical_tokens_of_a_valid_instance_are_accepted(smollm2_vocab):
    g = CACHE.get_json_schema(SCHEMA, smollm2_vocab)
    text = json.dumps(INSTANCE)
    state = g.walk(smollm2_vocab.encode(text))
    assert state >= 0 and g.is_accepting(state) and g.is_finished(state)
    jump = g.jump(0)
    assert jump.text == b'{"id":' and g.walk(jump.tokens) == jump.state


def _model(vocab):
    closing = np.array([bool(t) and any(c in t for c in b'"]}.') for t in vocab.tokens]) * 6.0
    closing[min(vocab.eos_ids)] += 4.0  # favour finishing, so the fake model's outputs end
    return lambda tokens: fake_logits(tokens, vocab.size) + closing


def test_greedy_jump_forward_is_identical_and_saves_steps(smollm2_vocab):
    for grammar in (CACHE.get_json_schema(SCHEMA, smollm2_vocab), CACHE.get_regex(PAPER, smollm2_vocab)):
        plain, plain_steps = greedy_decode(grammar, _model(smollm2_vocab), use_jump=False)
        jumped, jump_steps = greedy_decode(grammar, _model(smollm2_vocab), use_jump=True)
        assert grammar.walk(plain) == grammar.done  # finished with EOS
        assert plain == jumped and plain_steps > jump_steps
        if grammar.regex != PAPER:
            jsonschema.validate(json.loads(decode(smollm2_vocab, plain)), SCHEMA)
