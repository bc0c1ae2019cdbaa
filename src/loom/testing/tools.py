"""Twenty varied tool definitions in OpenAI's request shape, each with a valid and an invalid
example of its arguments, written by hand (shared by the tool-call parser, grammar and route
tests, and the ``tool_call_parser`` conformance kit).

They cover what real tools use: nested objects, arrays with bounds, enums, required and
optional fields, numbers with bounds, ``oneOf``/``anyOf``, type lists, patterns, ``const``,
``$defs`` with ``$ref`` (as pydantic writes them), a recursive schema, and no parameters at all.
Examples list properties in schema order, as the grammar backends generate them (xgrammar
separates with ``", "`` and ``": "``, llguidance with ``","`` and ``":"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolDef:
    tool: dict[str, Any]  # {"type": "function", "function": {...}}
    valid: dict[str, Any]  # arguments that validate against the parameters
    invalid: dict[str, Any] | None  # arguments that do not (None: the schema takes anything)

    @property
    def name(self) -> str:
        return self.tool["function"]["name"]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.tool["function"].get("parameters", {"type": "object", "properties": {}})


def _fn(name: str, description: str, parameters: dict[str, Any] | None, **extra) -> dict:
    fn: dict[str, Any] = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    fn.update(extra)
    return {"type": "function", "function": fn}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra) -> dict:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        out["required"] = required
    out.update(extra)
    return out


TOOL_DEFS: list[ToolDef] = [
    ToolDef(
        _fn(
            "get_weather",
            "Current weather in a city.",
            _obj(
                {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                ["city", "unit"],
            ),
        ),
        {"city": "Paris", "unit": "celsius"},
        {"city": "Paris", "unit": "kelvin"},
    ),
    ToolDef(_fn("get_time", "The current UTC time.", None), {}, {"zone": "UTC"}),
    ToolDef(
        _fn(
            "search_web",
            "Search the web.",
            _obj(
                {
                    "query": {"type": "string", "minLength": 1, "maxLength": 200},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 20},
                    "safe": {"type": "boolean"},
                },
                ["query"],
            ),
        ),
        {"query": "loom serving engine", "max_results": 5, "safe": True},
        {"query": "", "max_results": 50},
    ),
    ToolDef(
        _fn(
            "create_event",
            "Create a calendar event.",
            _obj(
                {
                    "title": {"type": "string"},
                    "start": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}$"},
                    "attendees": {
                        "type": "array",
                        "items": _obj(
                            {
                                "name": {"type": "string"},
                                "email": {"type": "string", "pattern": r"^[^@\s]+@[^@\s]+$"},
                            },
                            ["name", "email"],
                        ),
                        "minItems": 1,
                    },
                },
                ["title", "start", "attendees"],
            ),
        ),
        {
            "title": "Design review",
            "start": "2025-03-14T15:30",
            "attendees": [
                {"name": "Ada", "email": "ada@example.com"},
                {"name": "Linus", "email": "linus@example.org"},
            ],
        },
        {"title": "Design review", "start": "tomorrow", "attendees": []},
    ),
    ToolDef(
        _fn(
            "set_thermostat",
            "Set the target temperature.",
            _obj(
                {
                    "temperature": {"type": "number", "minimum": 5, "maximum": 35},
                    "mode": {"type": "string", "enum": ["heat", "cool", "auto"]},
                },
                ["temperature", "mode"],
            ),
        ),
        {"temperature": 21.5, "mode": "heat"},
        {"temperature": 80, "mode": "heat"},
    ),
    ToolDef(
        _fn(
            "send_email",
            "Send an email.",
            _obj(
                {
                    "to": {
                        "type": "array",
                        "items": {"type": "string", "pattern": r"^[^@\s]+@[^@\s]+$"},
                        "minItems": 1,
                    },
                    "subject": {"type": "string"},
                    "body": {"type": "string"},
                    "cc": {"type": "array", "items": {"type": "string"}},
                },
                ["to", "subject", "body"],
            ),
        ),
        {
            "to": ["bob@example.com"],
            "subject": 'Re: "quarterly" numbers',
            "body": "Hi Bob,\n\nSee the table below:\n\tQ1 = 10\n\tQ2 = 12\n\n-- A",
        },
        {"to": ["not an address"], "subject": "x", "body": "y"},
    ),
    ToolDef(
        _fn(
            "book_flight",
            "Book a flight.",
            _obj(
                {
                    "origin": _obj(
                        {
                            "airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "terminal": {"type": "string"},
                        },
                        ["airport"],
                    ),
                    "destination": _obj(
                        {"airport": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["airport"]
                    ),
                    "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                ["origin", "destination", "date", "passengers"],
            ),
        ),
        {
            "origin": {"airport": "CDG", "terminal": "2E"},
            "destination": {"airport": "SFO"},
            "date": "2025-07-01",
            "passengers": 2,
        },
        {
            "origin": {"airport": "cdg"},
            "destination": {"airport": "SFO"},
            "date": "2025-07-01",
            "passengers": 0,
        },
    ),
    ToolDef(
        _fn(
            "calculate",
            "Evaluate an arithmetic expression.",
            _obj(
                {
                    "expression": {"type": "string"},
                    "precision": {"type": "integer", "minimum": 0, "maximum": 10},
                },
                ["expression"],
            ),
        ),
        {"expression": "(2 + 3) * 4 / 7", "precision": 3},
        {"expression": 42},
    ),
    ToolDef(
        _fn(
            "translate",
            "Translate text.",
            _obj(
                {
                    "text": {"type": "string"},
                    "target": {"type": "string", "enum": ["de", "en", "fr", "ja", "zh"]},
                    "formal": {"type": "boolean"},
                },
                ["text", "target"],
            ),
        ),
        {"text": "Où est la gare ? 駅はどこですか", "target": "en", "formal": False},
        {"text": "hello", "target": "klingon"},
    ),
    ToolDef(
        _fn(
            "update_inventory",
            "Change stock levels.",
            _obj(
                {
                    "items": {
                        "type": "array",
                        "items": _obj(
                            {
                                "sku": {"type": "string", "pattern": "^SKU-[0-9]{4}$"},
                                "quantity": {"type": "integer", "minimum": 0},
                            },
                            ["sku", "quantity"],
                        ),
                        "minItems": 1,
                        "maxItems": 5,
                    }
                },
                ["items"],
            ),
        ),
        {"items": [{"sku": "SKU-0001", "quantity": 3}, {"sku": "SKU-0420", "quantity": 0}]},
        {"items": [{"sku": "SKU-1", "quantity": -1}]},
    ),
    ToolDef(
        _fn(
            "set_reminder",
            "Remind me at a time or after a delay.",
            _obj(
                {
                    "text": {"type": "string"},
                    "when": {
                        "anyOf": [
                            _obj({"at": {"type": "string"}}, ["at"]),
                            _obj(
                                {"in_minutes": {"type": "integer", "minimum": 1}},
                                ["in_minutes"],
                            ),
                        ]
                    },
                },
                ["text", "when"],
            ),
        ),
        {"text": "stretch", "when": {"in_minutes": 45}},
        {"text": "stretch", "when": {"in_minutes": 0}},
    ),
    ToolDef(
        _fn(
            "query_database",
            "Run a parameterised SQL query.",
            _obj(
                {
                    "sql": {"type": "string"},
                    "params": {"type": "array", "items": {"type": ["string", "number", "null"]}},
                    "timeout_s": {"type": ["number", "null"]},
                },
                ["sql", "params", "timeout_s"],
            ),
        ),
        {
            "sql": "SELECT * FROM t WHERE a = ? AND b > ?",
            "params": ["x", 2.5, None],
            "timeout_s": None,
        },
        {"sql": "SELECT 1", "params": [True], "timeout_s": None},
    ),
    ToolDef(
        _fn(
            "resize_image",
            "Resize an image.",
            _obj(
                {
                    "width": {"type": "integer", "exclusiveMinimum": 0, "maximum": 8192},
                    "height": {"type": "integer", "exclusiveMinimum": 0, "maximum": 8192},
                    "keep_aspect": {"type": "boolean"},
                    "format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
                },
                ["width", "height"],
            ),
        ),
        {"width": 640, "height": 480, "keep_aspect": True, "format": "webp"},
        {"width": 0, "height": 480},
    ),
    ToolDef(
        _fn(
            "get_stock_price",
            "Latest price of a stock.",
            _obj(
                {
                    "symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                    "exchange": {"type": "string", "enum": ["NYSE", "NASDAQ", "LSE"]},
                },
                ["symbol"],
            ),
        ),
        {"symbol": "NVDA", "exchange": "NASDAQ"},
        {"symbol": "nvidia"},
    ),
    ToolDef(
        _fn(
            "add",
            "Add two numbers.",
            _obj({"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
        ),
        {"a": -3, "b": 1.25e-3},
        {"a": "1", "b": 2},
    ),
    ToolDef(
        _fn(
            "run_code",
            "Run a snippet of code.",
            _obj(
                {
                    "language": {"type": "string", "enum": ["python", "bash"]},
                    "code": {"type": "string"},
                },
                ["language", "code"],
                additionalProperties=False,
            ),
            strict=True,
        ),
        {
            "language": "python",
            "code": 'def f(x):\n    return {"x": x, "s": \'q\\\\n\'}  # [f(1)] </tool_call>\nprint(f(1))',
        },
        {"language": "python", "code": "1", "extra": True},
    ),
    ToolDef(
        _fn(
            "tag_document",
            "Tag a document.",
            _obj(
                {
                    "document_id": {"type": "integer"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["urgent", "finance", "legal", "hr"]},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                ["document_id", "tags"],
            ),
        ),
        {"document_id": 1042, "tags": ["finance", "urgent"]},
        {"document_id": 1042, "tags": ["a", "b", "c", "d"]},
    ),
    ToolDef(
        _fn(
            "place_order",
            "Place an order (a schema as pydantic writes it: $defs and $ref).",
            {
                "$defs": {
                    "Item": _obj(
                        {
                            "product": {"type": "string"},
                            "count": {"type": "integer", "minimum": 1},
                        },
                        ["product", "count"],
                        title="Item",
                    ),
                    "Address": _obj(
                        {
                            "street": {"type": "string"},
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        ["street", "city", "zip"],
                        title="Address",
                    ),
                },
                **_obj(
                    {
                        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                        "ship_to": {"$ref": "#/$defs/Address"},
                    },
                    ["items", "ship_to"],
                    title="PlaceOrder",
                ),
            },
        ),
        {
            "items": [{"product": "tea", "count": 2}],
            "ship_to": {"street": "1 Main St", "city": "Springfield", "zip": "12345"},
        },
        {"items": [{"product": "tea", "count": 0}], "ship_to": {"street": "x", "city": "y"}},
    ),
    ToolDef(
        _fn(
            "navigate",
            "Route to a place given by coordinates or by address.",
            _obj(
                {
                    "destination": {
                        "oneOf": [
                            _obj(
                                {
                                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                                },
                                ["lat", "lon"],
                            ),
                            {"type": "string", "minLength": 3},
                        ]
                    },
                    "mode": {"const": "driving"},
                },
                ["destination", "mode"],
            ),
        ),
        {"destination": {"lat": 48.8584, "lon": 2.2945}, "mode": "driving"},
        {"destination": {"lat": 123, "lon": 0}, "mode": "walking"},
    ),
    ToolDef(
        _fn(
            "save_outline",
            "Save an outline: a recursive tree of headings.",
            {
                "$defs": {
                    "Node": _obj(
                        {
                            "title": {"type": "string"},
                            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                        },
                        ["title", "children"],
                    )
                },
                **_obj({"root": {"$ref": "#/$defs/Node"}}, ["root"]),
            },
        ),
        {
            "root": {
                "title": "Intro",
                "children": [{"title": "Why", "children": []}, {"title": "How", "children": []}],
            }
        },
        {"root": {"title": "Intro", "children": [{"title": 1, "children": []}]}},
    ),
]

TOOLS: list[dict[str, Any]] = [d.tool for d in TOOL_DEFS]
BY_NAME: dict[str, ToolDef] = {d.name: d for d in TOOL_DEFS}
