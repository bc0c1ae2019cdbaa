"""25 JSON schemas of real-world shape (structured-output tests and `loom bench structured`).

They cover nested objects, arrays with minItems/maxItems, enums, string patterns and formats,
numeric ranges, anyOf, $ref/$defs, optional fields and additionalProperties. Strings carry
maxLength so that a small model's outputs stay short.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}
NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: list[tuple[str, dict]] = [
    (
        "A user profile.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "A product in a catalog.",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "in_stock"],
        },
    ),
    (
        "An address.",
        {
            "type": "object",
            "properties": {
                "street": S,
                "city": NAME,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
        },
    ),
    (
        "A to-do list with two to four items.",
        {
            "type": "object",
            "properties": {
                "title": S,
                "items": {"type": "array", "items": S, "minItems": 2, "maxItems": 4},
            },
            "required": ["title", "items"],
        },
    ),
    (
        "A log event.",
        {
            "type": "object",
            "properties": {
                "level": {"enum": ["debug", "info", "warning", "error"]},
                "message": S,
                "code": {"type": "integer", "minimum": 100, "maximum": 599},
            },
            "required": ["level", "message"],
        },
    ),
    (
        "An order with customer and line items.",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "customer": {
                    "type": "object",
                    "properties": {"name": NAME, "vip": {"type": "boolean"}},
                    "required": ["name", "vip"],
                },
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "product": S,
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["product", "quantity"],
                    },
                },
            },
            "required": ["order_id", "customer", "lines"],
        },
    ),
    (
        "A calendar date for a meeting.",
        {
            "type": "object",
            "properties": {"topic": S, "date": {"type": "string", "format": "date"}},
            "required": ["topic", "date"],
        },
    ),
    (
        "A contact with an email address.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "email": {
                    # xgrammar applies "format" alone (ignoring pattern and maxLength), and an
                    # unbounded email lets a sampling model ramble: a pattern keeps it short.
                    "type": "string",
                    "pattern": "^[a-z.]{1,16}@[a-z]{1,12}[.](com|org|net)$",
                },
            },
            "required": ["name", "email"],
        },
    ),
    (
        "A payment by card or by bank transfer.",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000},
                "method": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}
                            },
                            "required": ["card_last4"],
                        },
                        {
                            "type": "object",
                            "properties": {
                                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"}
                            },
                            "required": ["iban"],
                        },
                    ]
                },
            },
            "required": ["amount", "method"],
        },
    ),
    (
        "A family tree node with a parent and a child person.",
        {
            "$defs": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "born": {"type": "integer", "minimum": 1900, "maximum": 2025},
                    },
                    "required": ["name", "born"],
                }
            },
            "type": "object",
            "properties": {
                "parent": {"$ref": "#/$defs/person"},
                "child": {"$ref": "#/$defs/person"},
            },
            "required": ["parent", "child"],
        },
    ),
    (
        "A weather report.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
                "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
            },
            "required": ["city", "temperature_c", "conditions"],
        },
    ),
    (
        "A book with an optional subtitle and one to three authors.",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "subtitle": S,
                "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
            },
            "required": ["title", "authors", "year"],
        },
    ),
    (
        "An HTTP request description.",
        {
            "type": "object",
            "properties": {
                "method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                "path": {"type": "string", "pattern": "^/[a-z0-9/]{0,20}$"},
                "headers": {
                    "type": "object",
                    "properties": {"accept": S, "user_agent": S},
                    "required": ["accept"],
                },
            },
            "required": ["method", "path", "headers"],
        },
    ),
    (
        "A 2D point and a color.",
        {
            "type": "object",
            "properties": {
                "x": {"type": "number", "minimum": -100, "maximum": 100},
                "y": {"type": "number", "minimum": -100, "maximum": 100},
                "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
            "required": ["x", "y", "color"],
            "additionalProperties": False,
        },
    ),
    (
        "A list of exactly three tags.",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z]{2,10}$"},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "A movie rating.",
        {
            "type": "object",
            "properties": {
                "movie": NAME,
                "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
                "review": {"anyOf": [S, {"type": "null"}]},
            },
            "required": ["movie", "stars", "review"],
        },
    ),
    (
        "A server configuration.",
        {
            "type": "object",
            "properties": {
                "host": {"type": "string", "pattern": "^[a-z0-9.-]{1,20}$"},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": {"type": "boolean"},
                "workers": {"type": "integer", "minimum": 1, "maximum": 64},
            },
            "required": ["host", "port", "tls"],
        },
    ),
    (
        "A recipe with ingredients and steps.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": S,
                            "grams": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                        "required": ["item", "grams"],
                    },
                },
                "steps": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
            },
            "required": ["name", "ingredients", "steps"],
        },
    ),
    (
        "A flight booking.",
        {
            "type": "object",
            "properties": {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "class": {"enum": ["economy", "business", "first"]},
            },
            "required": ["from", "to", "passengers", "class"],
        },
    ),
    (
        "A sensor reading, numeric or textual.",
        {
            "type": "object",
            "properties": {
                "sensor": NAME,
                "value": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 100}, S]},
            },
            "required": ["sensor", "value"],
        },
    ),
    (
        "A company with departments.",
        {
            "$defs": {
                "dept": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "headcount": {"type": "integer", "minimum": 1, "maximum": 500},
                    },
                    "required": ["name", "headcount"],
                }
            },
            "type": "object",
            "properties": {
                "company": NAME,
                "departments": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/dept"},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["company", "departments"],
        },
    ),
    (
        "A feature flag.",
        {
            "type": "object",
            "properties": {
                "key": {"type": "string", "pattern": "^[a-z_]{3,20}$"},
                "enabled": {"type": "boolean"},
                "rollout_percent": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["key", "enabled"],
            "additionalProperties": False,
        },
    ),
    (
        "A student grade record.",
        {
            "type": "object",
            "properties": {
                "student": NAME,
                "grades": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "passed": {"type": "boolean"},
            },
            "required": ["student", "grades", "passed"],
        },
    ),
    (
        "A geographic location.",
        {
            "type": "object",
            "properties": {
                "place": NAME,
                # whole degrees: a sampled float can run to hundreds of digits in either backend
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["place", "lat", "lon"],
        },
    ),
    (
        "A chat message with a role.",
        {
            "type": "object",
            "properties": {
                "role": {"enum": ["system", "user", "assistant"]},
                "content": S,
                "metadata": {
                    "type": "object",
                    "properties": {"lang": {"type": "string", "enum": ["en", "fr", "de"]}},
                },
            },
            "required": ["role", "content"],
        },
    ),
]

assert len(SCHEMAS) == 25
