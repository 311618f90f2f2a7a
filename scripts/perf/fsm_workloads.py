"""The grammars scripts/perf/bench_fsm_peers.py compiles with every library: regexes and JSON schemas, each with a
valid example the token walk follows (schemas closed to extra properties, as xgrammar's strict mode reads them)."""

from __future__ import annotations

REGEXES = {
    "phone": (r"(\+1 )?\(?[0-9]{3}\)?[ .-]?[0-9]{3}[.-][0-9]{4}", "+1 (555) 123-4567"),
    "email": (r"[a-z0-9._%+-]+@[a-z0-9-]+(\.[a-z0-9-]+)*\.[a-z]{2,6}", "jane.doe+news@mail.example-corp.com"),
    "iso_datetime": (
        r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
        r"(\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
        "2024-03-15T14:30:00.123+02:00",
    ),
    "ipv4": (
        r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
        "192.168.10.254",
    ),
    # scripts/perf/bench_fsm.py's paper regex with [\w\d\s] spelled out as ASCII (our dialect's meaning)
    "paper_regex": (
        r'\{"summary": "[A-Za-z0-9_ \t\n\r\f\v]+\.", "grade": "[ABCD][+-]?"\}',
        '{"summary": "The essay argues well but cites no sources.", "grade": "B+"}',
    ),
}

SCHEMAS = {
    # scripts/perf/bench_fsm.py's schema: nested object, enum, array of strings, pattern
    "user_nested": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "name": {"type": "string", "maxLength": 20},
                "email": {"type": "string"},
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
            "required": ["id", "name", "email", "role", "active", "score", "tags", "address"],
        },
        {
            "id": 42,
            "name": "Ada Lovelace",
            "email": "ada@example.com",
            "role": "admin",
            "active": True,
            "score": 97.5,
            "tags": ["math", "poetry"],
            "address": {"street": "12 St James Square", "city": "London", "zip": "10001"},
        },
    ),
    # array of objects, integer ranges, number >= 0
    "order_items": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "qty", "price"],
                    },
                },
                "status": {"enum": ["pending", "shipped", "delivered"]},
            },
            "required": ["order_id", "items", "status"],
        },
        {
            "order_id": 1001,
            "items": [{"sku": "ABC-1234", "qty": 2, "price": 19.99}, {"sku": "XYZ-0042", "qty": 12, "price": 5}],
            "status": "shipped",
        },
    ),
    # event: formats, anyOf, optional property, nested object
    "event": (
        {
            "type": "object",
            "properties": {
                "event": {"enum": ["click", "view", "purchase"]},
                "timestamp": {"type": "string", "format": "date-time"},
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "string", "format": "uuid"}, "premium": {"type": "boolean"}},
                    "required": ["id", "premium"],
                },
                "value": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                "note": {"type": "string", "maxLength": 40},
            },
            "required": ["event", "timestamp", "user", "value"],
        },
        {
            "event": "purchase",
            "timestamp": "2024-05-01T12:00:00Z",
            "user": {"id": "3f2b8c1e-9a4d-4e2f-8b6a-1c2d3e4f5a6b", "premium": True},
            "value": 49.9,
            "note": "gift wrap, leave at the door",
        },
    ),
}


def _closed(schema):
    """additionalProperties: false on every object: our converter (and xgrammar's strict mode) emits only the
    declared properties, while llguidance follows JSON Schema and would otherwise allow any extra key."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_closed(v) for v in schema]
    return schema


SCHEMAS = {name: (_closed(schema), example) for name, (schema, example) in SCHEMAS.items()}
