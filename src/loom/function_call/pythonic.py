"""The ``pythonic`` format (Llama 3.2 and Llama 4 with pythonic tool calling): a Python list of
calls with keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2)]``, opening the output
or wrapped in ``<|python_start|>`` ... ``<|python_end|>``.

The list is read with Python's ``ast`` (never evaluated) once it closes, so its calls arrive
whole, arguments converted to JSON. A list is calls only if every element is a call, by name,
with keyword arguments only whose values are literals (JSON's ``true``/``false``/``null`` are
accepted as well as Python's), to a known tool; otherwise the list is content.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from loom.function_call.base import IdFactory, ToolCall, ToolCallParser, ToolCallStream
from loom.function_call.stream import CallStream, skip_ws
from loom.function_call.tools import Tool

_QUOTE_OR_BRACKET = re.compile(r"[\"'()\[\]{}]")
_NAMED_CONSTANTS = {"true": True, "false": False, "null": None}
_NOT_JSON = object()


class PythonScanner:
    """Finds the bracket that closes a Python list, skipping strings (triple-quoted too)."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""  # the open string's delimiter
        self.pos = 0

    def scan(self, text: str, final: bool) -> int | None:
        """End (exclusive) of the list starting at ``text[0]``, None while it is open."""
        i, n = self.pos, len(text)
        while i < n:
            if self.quote:
                end = _string_end(text, i, self.quote)
                if end is None:  # rescan only the end, where the closing quote may begin
                    i = max(i, n - len(self.quote) + 1)
                    break
                self.quote = ""
                i = end
                continue
            m = _QUOTE_OR_BRACKET.search(text, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = text[i]
            if c in "\"'":
                if i + 3 > n and not final:  # a triple quote cannot be told yet
                    break
                self.quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(self.quote)
            elif c in "([{":
                self.depth += 1
                i += 1
            else:
                self.depth -= 1
                i += 1
                if self.depth <= 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


def _string_end(text: str, i: int, quote: str) -> int | None:
    """Index after the closing ``quote`` in ``text[i:]`` (escapes honoured), or None."""
    while True:
        j = text.find(quote, i)
        if j == -1:
            return None
        k = j
        while k > 0 and text[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:
            return j + len(quote)
        i = j + 1


def _value(node: ast.AST) -> Any:
    """A literal as a JSON value, or ``_NOT_JSON``."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float) and math.isfinite(v):
            return v
        return _NOT_JSON
    if isinstance(node, ast.Name):
        return _NAMED_CONSTANTS.get(node.id, _NOT_JSON)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return _NOT_JSON
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_value(e) for e in node.elts]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _value(k) if k is not None else _NOT_JSON
            value = _value(v)
            if not isinstance(key, str) or value is _NOT_JSON:
                return _NOT_JSON
            out[key] = value
        return out
    return _NOT_JSON


def parse_call_list(text: str, known: Callable[[str], bool]) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a pythonic call list, or None when it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for call in tree.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            return None
        if not known(call.func.id) or call.args:
            return None
        args = {}
        for kw in call.keywords:
            value = _value(kw.value)
            if kw.arg is None or value is _NOT_JSON:
                return None
            args[kw.arg] = value
        calls.append((call.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class PythonicStream(CallStream):
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self, tools: Sequence[Tool], id_factory: IdFactory) -> None:
        super().__init__(tools, id_factory)
        self._at_start = True
        self._list_at = 0
        self._py = PythonScanner()

    def text(self) -> bool:
        if self._at_start:
            i = skip_ws(self.buf, 0)
            if i == len(self.buf) and not self.final:
                return False
            self._at_start = False
            if i < len(self.buf) and self.buf[i] == "[":
                return self._start_list(0, i)
        progress, marker = self.content_until_marker((self.START,))
        if marker is None:
            return progress
        i = skip_ws(self.buf, len(self.START))
        if i == len(self.buf) and not self.final:
            return False
        if i < len(self.buf) and self.buf[i] == "[":
            return self._start_list(len(self.START), i)
        return self.give_up(len(self.START))

    def _start_list(self, skip: int, at: int) -> bool:
        self._skip, self._list_at = skip, at
        self._py = PythonScanner()
        self.state = self._list
        return True

    def _list(self) -> bool:
        body = self.buf[self._list_at :]
        end = self._py.scan(body, self.final)
        if end is None:
            return self.give_up(self._skip) if self.final else False
        calls = parse_call_list(body[:end], self.known)
        if calls is None:
            return self.give_up(self._skip)
        self.consume(self._list_at + end)
        for name, args in calls:
            self.begin_call(name)
            self.arguments(args)
            self.end_call()
        self.state = self._end_marker
        return True

    def _end_marker(self) -> bool:
        i = skip_ws(self.buf, 0)
        rest = self.buf[i:]
        if rest.startswith(self.END):
            self.consume(i + len(self.END))
        elif not self.final and self.END.startswith(rest):
            return False
        self.state = self.text
        return True


def _literal(value: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


class PythonicParser(ToolCallParser):
    """``[f(a=1, b="x"), g()]``; see the module's docstring."""

    template_signals = ("<|python_start|>", "func_name1(")
    template_priority = 20

    def detect(self, text: str) -> bool:
        return PythonicStream.START in text or text.lstrip().startswith("[")

    def streaming(self, tools: Sequence[Tool]) -> ToolCallStream:
        return PythonicStream(tools, self.id_factory)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        parts = []
        for c in calls:
            args = json.loads(c.arguments)
            parts.append(
                f"{c.name}(" + ", ".join(f"{k}={_literal(v)}" for k, v in args.items()) + ")"
            )
        return "[" + ", ".join(parts) + "]"
