"""Which JSON-schema keywords each grammar backend enforces, and the walk that finds the ones it
would drop, so that a schema is never compiled with a bound silently missing.

Measured on xgrammar 0.2.9 and llguidance 1.9.1 by feeding a valid and an invalid instance of a
one-keyword schema through each backend's matcher (``tests/test_schema_support.py`` keeps that
check for every rule below):

- XGrammar drops ``minLength`` / ``maxLength`` beside ``pattern`` or ``format`` (it logs a
  warning), ``allOf`` with several schemas, ``uniqueItems``, ``not``, ``dependentRequired``,
  ``dependentSchemas`` and ``if`` / ``then`` / ``else``, and ignores formats it does not know;
  with ``patternProperties`` or ``contains`` it refuses valid answers. llguidance enforces the
  first three (intersecting the length with the pattern) and refuses the rest when compiling.
- The ``xgrammar`` backend therefore compiles a schema that needs only what llguidance adds with
  llguidance (``schema_gaps(..., "xgrammar")`` marks those gaps ``llguidance``); any other gap
  is a 400 that names the keyword and its place in the schema (a JSON pointer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# formats each backend turns into a grammar (others it ignores or refuses)
_FORMATS = {"email", "uri", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6"}
_FORMATS.add("hostname")
FORMATS = {
    "xgrammar": frozenset(_FORMATS | {"uri-reference", "json-pointer"}),
    "llguidance": frozenset(_FORMATS),
}
# keywords that constrain the answer and that a backend cannot enforce (in any form)
_NEITHER = {"uniqueItems", "not", "contains", "minContains", "maxContains", "dependentRequired"}
_NEITHER |= {"dependentSchemas", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems"}
UNSUPPORTED = {
    "xgrammar": frozenset(_NEITHER),
    "llguidance": frozenset(_NEITHER | {"propertyNames"}),
}

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else")
_ONE += ("contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


@dataclass(frozen=True)
class Gap:
    """A keyword at ``pointer`` that the backend would not enforce; ``llguidance``: llguidance
    enforces it."""

    keyword: str
    pointer: str
    llguidance: bool = False

    def message(self, backend: str, kind: str = "json_schema") -> str:
        where = f"at {self.pointer}" if self.pointer != "#" else "at the schema's root"
        return (
            f"{kind}: {self.keyword} {where} is not enforced by the {backend} grammar "
            "backend, so an answer could break it: remove it or express it another way"
        )


def subschemas(schema: Any, pointer: str = "#") -> Iterator[tuple[dict, str]]:
    """Every schema object inside ``schema`` (itself included), with its JSON pointer."""
    if not isinstance(schema, dict):
        return
    yield schema, pointer
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield from subschemas(sub, f"{pointer}/{key}/{_escape(name)}")
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield from subschemas(sub, f"{pointer}/{key}/{i}")
    for key in _ONE:
        sub = schema.get(key)
        if isinstance(sub, list):  # (draft-7 tuple ``items``)
            for i, s in enumerate(sub):
                yield from subschemas(s, f"{pointer}/{key}/{i}")
        else:
            yield from subschemas(sub, f"{pointer}/{key}")


def schema_gaps(schema: Any, backend: str) -> list[Gap]:
    """What ``backend`` (``xgrammar`` or ``llguidance``) would not enforce in ``schema``."""
    gaps = []
    for sub, ptr in subschemas(schema):
        for key in sorted(UNSUPPORTED[backend] & sub.keys()):
            if key == "uniqueItems" and sub[key] is False:
                continue  # (the default: asks nothing)
            gaps.append(Gap(key, ptr))
        fmt = sub.get("format")
        if isinstance(fmt, str) and fmt not in FORMATS[backend]:
            llg = backend == "xgrammar" and fmt in FORMATS["llguidance"]
            gaps.append(Gap(f"format {fmt!r}", ptr, llg))
        if backend != "xgrammar":
            continue
        bounded = sub.get("minLength", 0) or sub.get("maxLength") is not None
        if bounded and ("pattern" in sub or "format" in sub):
            name = "maxLength" if "maxLength" in sub else "minLength"
            other = "pattern" if "pattern" in sub else "format"
            gaps.append(Gap(f"{name} beside {other}", ptr, True))
        if isinstance(sub.get("allOf"), list) and len(sub["allOf"]) > 1:
            gaps.append(Gap("allOf", ptr, True))
        if sub.get("patternProperties"):
            gaps.append(Gap("patternProperties", ptr, True))
    return gaps


_YEAR = "(?:000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_DAY = (
    "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29"
)
# RFC 3339 full-date with each month's length and leap years (years 0001-9999, as Python's
# date and so jsonschema's format checker take them)
DATE_PATTERN = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_DAY})$"


def calendar_dates(node: Any) -> Any:
    """``node`` with every ``format: date`` string that has no ``pattern`` given
    ``DATE_PATTERN`` instead: both grammar libraries check the format by its shape only
    (XGrammar 0.2.9 takes ``2023-06-31``, llguidance 1.9 ``2023-02-29``)."""
    if isinstance(node, list):
        return [calendar_dates(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: calendar_dates(v) for k, v in node.items()}
    if out.get("format") == "date" and "pattern" not in out and out.get("type") == "string":
        del out["format"]
        out["pattern"] = DATE_PATTERN
    return out


def check_schema(text: str, backend: str) -> tuple[Any, list[Gap]]:
    """The parsed schema (``calendar_dates`` applied) and its gaps for ``backend``; a
    GrammarError (a 400) for text that is not JSON, or for the first gap that no backend here
    would enforce."""
    import json

    from loom.constrained.base import GrammarError

    try:
        schema = calendar_dates(json.loads(text))
    except ValueError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from e
    gaps = schema_gaps(schema, backend)
    hard = [g for g in gaps if not g.llguidance] or (
        schema_gaps(schema, "llguidance") if gaps else []
    )
    if hard:
        raise GrammarError(hard[0].message(backend))
    return schema, gaps


def check_tag_schemas(text: str) -> None:
    """A structural tag's JSON schemas (any ``schema`` / ``json_schema`` object in it), checked
    for XGrammar with no llguidance to fall back on (llguidance has no structural tags)."""
    import json

    from loom.constrained.base import GrammarError

    def schemas(node: Any, ptr: str) -> Iterator[tuple[dict, str]]:
        if isinstance(node, dict):
            for key, value in node.items():
                here = f"{ptr}/{_escape(str(key))}"
                if key in ("schema", "json_schema") and isinstance(value, dict):
                    yield value, here
                else:
                    yield from schemas(value, here)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from schemas(value, f"{ptr}/{i}")

    try:
        tag = json.loads(text)
    except ValueError:
        return  # (XGrammar's own error names it)
    for schema, ptr in schemas(tag, "#"):
        gaps = schema_gaps(schema, "xgrammar")
        if gaps:
            gap = gaps[0]
            where = ptr + gap.pointer[1:]
            raise GrammarError(Gap(gap.keyword, where).message("xgrammar", "structural_tag"))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
