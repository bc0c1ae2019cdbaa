"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` request fields, checked and
normalised into :class:`ToolRequest`.

Every refusal is a :class:`ToolSpecError` (a ``ValueError``) whose ``param`` is the path of the
offending field as the client wrote it (``tools[2].function.parameters.properties.x``), so a
route can answer OpenAI's 400 naming it. Leniencies, each the way vLLM and SGLang accept them:
``tools: []`` means no tools; an entry without ``type`` is a function; ``tool_choice`` ``"auto"``
or ``"none"`` without tools is accepted (and means ``"none"``), while ``"required"`` or a named
function without tools is refused, as OpenAI does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICE_MODES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """A bad tools field; ``param`` is its path in the request body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    """One function the model may call. ``parameters`` is its JSON schema (an object schema;
    ``{"type": "object", "properties": {}}`` when the request gave none)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The normalised OpenAI shape, as chat templates expect ``tools`` entries."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        if self.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is ``none``, ``auto``, ``required`` or ``named`` (then ``name`` is the tool)."""

    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None

    def describe(self) -> str:
        """As the request wrote it, for messages: ``"required"``, ``function 'f'``."""
        return f"function {self.name!r}" if self.mode == "named" else repr(self.mode)


class ToolRequest(NamedTuple):
    """A request's tools after validation; ``choice.mode`` is ``"none"`` whenever there are
    none. Unpacks as ``tools, choice, parallel``."""

    tools: list[Tool]
    choice: ToolChoice
    parallel: bool  # parallel_tool_calls: more than one call per turn allowed

    @property
    def enabled(self) -> bool:
        """Whether the output may hold tool calls (and so should be parsed for them)."""
        return bool(self.tools) and self.choice.mode != "none"

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def parse_tool_fields(
    tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None
) -> ToolRequest:
    """Check and normalise a chat request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` (None: absent); raises :class:`ToolSpecError`."""
    checked = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, checked)
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    elif not isinstance(parallel_tool_calls, bool):
        raise ToolSpecError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    return ToolRequest(checked, choice, parallel_tool_calls)


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ToolSpecError("tools", "tools must be an array of tool objects")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(value):
        tool = parse_tool(entry, f"tools[{i}]")
        if tool.name in seen:
            raise ToolSpecError(
                f"tools[{i}].function.name",
                f"duplicate function name {tool.name!r} (also tools[{seen[tool.name]}])",
            )
        seen[tool.name] = i
        tools.append(tool)
    return tools


def parse_tool(entry: Any, path: str) -> Tool:
    if not isinstance(entry, Mapping):
        raise ToolSpecError(
            path, f'{path} must be an object {{"type": "function", "function": ...}}'
        )
    kind = entry.get("type", "function")
    if kind != "function":
        raise ToolSpecError(f"{path}.type", f'{path}.type must be "function", got {kind!r}')
    fn = entry.get("function")
    if not isinstance(fn, Mapping):
        raise ToolSpecError(f"{path}.function", f"{path}.function must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ToolSpecError(
            f"{path}.function.name",
            f"{path}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSpecError(f"{path}.function.description", "description must be a string")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolSpecError(f"{path}.function.strict", "strict must be a boolean")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    else:
        check_parameters(parameters, f"{path}.function.parameters", name)
    return Tool(name, description, dict(parameters), bool(strict))


def check_parameters(schema: Any, path: str, name: str) -> None:
    """``schema`` is a JSON schema (draft 2020-12) of an object: a JSON object whose ``type``,
    when given, is ``"object"``."""
    if not isinstance(schema, Mapping):
        raise ToolSpecError(path, f"parameters of function {name!r} must be a JSON schema object")
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise ToolSpecError(
            f"{path}.type",
            f'parameters of function {name!r} must be a schema of type "object", got {kind!r}',
        )
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:  # an optional check: the grammar backend refuses bad schemas later
        logger.debug("jsonschema is not installed; tool parameter schemas are not checked")
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = path + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise ToolSpecError(
            where, f"parameters of function {name!r} are not a valid JSON schema: {e.message}"
        ) from None


def parse_tool_choice(value: Any, tools: Sequence[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise ToolSpecError(
                "tool_choice",
                f"tool_choice must be one of {', '.join(CHOICE_MODES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}',
            )
        if value == "required" and not tools:
            raise ToolSpecError("tool_choice", 'tool_choice "required" needs tools')
        return ToolChoice(value if tools else "none")  # type: ignore[arg-type]
    if not isinstance(value, Mapping):
        raise ToolSpecError("tool_choice", "tool_choice must be a string or an object")
    if value.get("type") != "function":
        raise ToolSpecError("tool_choice.type", 'tool_choice.type must be "function"')
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise ToolSpecError(
            "tool_choice.function.name", "tool_choice.function.name must be a string"
        )
    if not any(t.name == name for t in tools):
        known = ", ".join(t.name for t in tools) or "none given"
        raise ToolSpecError(
            "tool_choice.function.name",
            f"tool_choice names function {name!r}, which is not among the tools ({known})",
        )
    return ToolChoice("named", name)
