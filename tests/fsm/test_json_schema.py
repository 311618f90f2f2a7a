"""JSON schema -> regex: random walks through the grammar give JSON that validates."""

import json

import jsonschema
import numpy as np
import pytest
from fsm_helpers import EOS, TOY, decode

from sgjax.fsm import GrammarError, JsonOptions, compile_grammar, schema_to_regex

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", None, 3]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
ORDER = {
    "type": "object",
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer", "exclusiveMinimum": 0},
                "price": {"type": "number", "minimum": 0},
            },
            "required": ["sku", "qty", "price"],
        }
    },
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "status": {"const": "open"},
        "created": {"type": "string", "format": "date-time"},
    },
    "required": ["id", "items", "status"],
}
NESTED = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 20},
        "grade": {"enum": ["A", "B", "C"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        "meta": {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}},
                "flag": {"type": ["boolean", "null"]},
            },
        },
        "empty": {"type": "object", "additionalProperties": False},
    },
}
SCHEMAS = [PERSON, ORDER, NESTED]


def _random_walk(g, rng, max_steps=300):
    state, out = 0, []
    for _ in range(max_steps):
        allowed = g.allowed_tokens(state)
        # Prefer EOS when allowed (bounded outputs), otherwise pick uniformly among allowed tokens,
        # with a bias towards structure so objects close in time.
        if EOS in allowed and rng.random() < 0.8:
            return out
        tok = int(rng.choice(allowed))
        out.append(tok)
        state = g.next_state(state, tok)
    return None


@pytest.mark.parametrize("options", [JsonOptions(), JsonOptions(whitespace="[ \n]?")])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "order", "nested"])
def test_random_walks_validate(schema, options):
    assert _validated_walks(schema, options, seed=0, tries=40) >= 10


def _validated_walks(schema, options, seed, tries):
    """How many of `tries` random walks through the schema's grammar ended; each one must validate."""
    g = compile_grammar(schema_to_regex(schema, options), TOY)
    rng = np.random.default_rng(seed)
    done = 0
    for _ in range(tries):
        ids = _random_walk(g, rng)
        if ids is None:
            continue
        jsonschema.validate(json.loads(decode(TOY, ids)), schema)
        done += 1
    return done


def test_fixed_separators_and_optional_properties():
    rx = schema_to_regex(PERSON)
    g = compile_grammar(rx, TOY)
    for text in [
        '{"name": "a", "age": 7}',
        '{"name": "a", "age": 120, "active": true}',
        '{"name": "é", "age": 0, "role": null, "active": false}',
    ]:
        assert g.dfa.accepts(text.encode()), text
    for text in [
        '{"age": 7, "name": "a"}',
        '{"name": "a","age": 7}',
        '{"name": "", "age": 7}',
        '{"name": "a", "age": 121}',
        '{"name": "a"}',
        '{"name": "a", "age": 7, }',
    ]:
        assert not g.dfa.accepts(text.encode()), text


@pytest.mark.parametrize(
    "schema,path",
    [
        ({"type": "object", "properties": {"child": {"$ref": "#"}}}, "#/properties/child"),
        ({"type": "object", "properties": {"x": {"type": "string", "not": {}}}}, "#/properties/x"),
        (
            {
                "type": "array",
                "items": {"type": "object", "properties": {"a": {"type": "string", "patternProperties": {}}}},
            },
            "#/items/properties/a",
        ),
        ({"type": "number", "maximum": 3}, "#"),
    ],
)
def test_unsupported_raises_with_path(schema, path):
    with pytest.raises(GrammarError) as err:
        schema_to_regex(schema)
    assert str(err.value).startswith(path + ":")


FREE = [
    {"type": "object"},
    {},
    {"type": "array", "maxItems": 3},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
    {"type": "object", "properties": {"id": {"type": "integer"}, "extra": {}}, "required": ["id"]},
]


@pytest.mark.parametrize("schema", FREE, ids=["object", "any", "array", "map", "nested-any"])
def test_free_form_values_validate(schema):
    # Free-form parts (json_object's {"type": "object"}, `{}`, an array without items, a map): any JSON of
    # containers nested at most FREE_DEPTH deep.
    assert _validated_walks(schema, None, seed=1, tries=60) >= 10


def test_free_object_accepts_any_json_object_up_to_the_depth():
    g = compile_grammar(schema_to_regex({"type": "object"}), TOY)
    deep = '{"a": [1, {"b": [null]}]}'  # 4 levels of containers
    for text in [
        "{}",
        '{"a": 1}',
        '{"a": -1.5e3, "b": "x\\n", "": [true, false, null]}',
        deep,
        '{"k": {"k": {"k": {}}}}',
    ]:
        assert g.dfa.accepts(text.encode()), text
    for text in ["[]", '{"a": 1,}', "{'a': 1}", '{"a" 1}', '{"a": [1, {"b": [[null]]}]}', '{"a": 01}']:
        assert not g.dfa.accepts(text.encode()), text
    empty = compile_grammar(schema_to_regex({"type": "object", "additionalProperties": False}), TOY)
    assert empty.dfa.accepts(b"{}") and not empty.dfa.accepts(b'{"a": 1}')
