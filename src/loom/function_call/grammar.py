"""What the grammar backend enforces for ``tool_choice`` ``required`` and a named function, and
how the constrained output becomes calls.

- named: the output *is* the arguments object, so the constraint is the function's
  ``parameters`` schema; the call's name is the chosen one.
- required: the output is a JSON array of one or more ``{"name": NAME, "parameters": {...}}``
  objects, ``anyOf`` over the tools (at most one element when ``parallel_tool_calls`` is false).

Either way the arguments always parse and validate against the tool's schema, whatever the
model. ``$ref``s inside a tool's schema keep working once embedded: its ``$defs`` move to the
root under the tool's own prefix and the references are rewritten to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.function_call.base import (
    IdFactory,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    fold_events,
    new_call_id,
)
from loom.function_call.stream import CallStream, skip_ws
from loom.function_call.tools import Tool, ToolChoice

_DEFS_KEYS = ("$defs", "definitions")


def constraint_schema(
    tools: Sequence[Tool], choice: ToolChoice, parallel: bool = True
) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None when the model is free (auto, none)."""
    if not tools:
        return None
    if choice.mode == "named":
        tool = next((t for t in tools if t.name == choice.name), None)
        if tool is None:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        return tool.parameters
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(tools):
        branches.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.name},
                    "parameters": _embed(tool.parameters, f"tool{i}", defs),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": branches[0] if len(branches) == 1 else {"anyOf": branches},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_has_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_has_ref(v) for v in schema)
    return False


def _embed(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as a sub-schema of another: unchanged without ``$ref``s, else moved with its
    definitions into ``defs`` (as ``prefix`` and ``prefix__NAME``) and referenced."""
    if not _has_ref(schema):
        return schema
    body = {k: v for k, v in schema.items() if k not in _DEFS_KEYS}
    defs[prefix] = _rewrite_refs(body, prefix)
    for key in _DEFS_KEYS:
        for name, sub in (schema.get(key) or {}).items():
            defs[f"{prefix}__{name}"] = _rewrite_refs(sub, prefix)
    return {"$ref": f"#/$defs/{prefix}"}


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, prefix) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        for key in _DEFS_KEYS:
            head = f"/{key}/"
            if pointer.startswith(head):
                out["$ref"] = f"#/$defs/{prefix}__{pointer[len(head) :]}"
                break
        else:
            out["$ref"] = f"#/$defs/{prefix}{pointer}"
    return out


class NamedCallStream(ToolCallStream):
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str, id_factory: IdFactory) -> None:
        self.name = name
        self.id_factory = id_factory
        self._started = False

    def _start(self) -> list[StreamEvent]:
        if self._started:
            return []
        self._started = True
        return [ToolCallDelta(0, "", self.id_factory(), self.name)]

    def feed(self, text: str) -> list[StreamEvent]:
        out = self._start()
        if text:
            out.append(ToolCallDelta(0, text))
        return out

    def finish(self) -> list[StreamEvent]:
        return self._start()


class RequiredCallsStream(CallStream):
    """tool_choice required: a JSON array of ``{"name": ..., "parameters": {...}}``."""

    def __init__(self, tools: Sequence[Tool] | None, id_factory: IdFactory) -> None:
        super().__init__(tools, id_factory)
        self._at_start = True

    def text(self) -> bool:
        if self._at_start:
            buf = self.buf
            i = skip_ws(buf, 0)
            j = skip_ws(buf, i + 1) if i < len(buf) else i
            if not self.final and j == len(buf) and (i == len(buf) or buf[i] == "["):
                return False
            self._at_start = False
            if i < len(buf) and buf[i] == "[" and j < len(buf) and buf[j] == "{":
                return self.start_array(j)
        if not self.buf:
            return False
        self.content(self.consume(len(self.buf)))  # nothing follows the array under the grammar
        return True


def constrained_streaming(
    tools: Sequence[Tool], choice: ToolChoice, id_factory: IdFactory = new_call_id
) -> ToolCallStream | None:
    """A stream over output generated under :func:`constraint_schema`, None when that is None
    (the model writes its own format: use the server's parser)."""
    if not tools:
        return None
    if choice.mode == "named":
        return NamedCallStream(choice.name or "", id_factory)
    if choice.mode == "required":
        return RequiredCallsStream(tools, id_factory)
    return None


def calls_from_required(
    text: str, tools: Sequence[Tool] | None = None, id_factory: IdFactory = new_call_id
) -> list[ToolCall]:
    """The calls of a complete ``required`` output (as streaming it gives them); ``tools``
    None accepts any name, as the grammar already allowed only the tools'."""
    s = RequiredCallsStream(tools, id_factory)
    return fold_events([*s.feed(text), *s.finish()]).calls
