"""The machinery the built-in formats share: scanners that find where a JSON (or Python) value
ends when it arrives in pieces, and :class:`CallStream`, a state machine over the unconsumed
text that emits content (holding back possible markers and the whitespace next to calls) and
JSON call objects ``{"name": ..., "arguments" | "parameters": {...}}`` argument piece by piece.

A state is a method that consumes from ``self.buf`` and returns True when it made progress
(consumed text or moved to another state) and False when it needs more text. At ``finish``
(``self.final``) every state must decide, so the loop ends with the buffer consumed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from loom.function_call.base import (
    ContentDelta,
    IdFactory,
    StreamEvent,
    ToolCallDelta,
    ToolCallStream,
)
from loom.function_call.tools import Tool

_WS = re.compile(r"[ \t\r\n]*")
_IN_STRING = re.compile(r'["\\]')
# Outside strings, JSON has only whitespace, punctuation, numbers and true/false/null: stop at
# anything else too (a structural character, or one that ends malformed JSON early).
_OUTSIDE = re.compile(r"[^ \t\r\n,:0-9.eE+\-trufalsn]")
_NAME = re.compile(r"[a-zA-Z0-9_-]*")
_ARGS_KEYS = ('"arguments"', '"parameters"')

PARTIAL, NO, YES = "partial", "no", "yes"


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def find_marker(text: str, markers: Sequence[str], pos: int = 0) -> tuple[int, str | None]:
    """The first marker in ``text[pos:]`` and its index, or (-1, None)."""
    found, which = -1, None
    for m in markers:
        i = text.find(m, pos)
        if i != -1 and (found == -1 or i < found):
            found, which = i, m
    return found, which


def expect(text: str, pos: int, literal: str) -> tuple[str, int]:
    """``literal`` after optional whitespace at ``pos``: (YES, end), (PARTIAL, pos) when the text
    ends inside it, else (NO, pos)."""
    i = skip_ws(text, pos)
    if text.startswith(literal, i):
        return YES, i + len(literal)
    return (PARTIAL if literal.startswith(text[i:]) else NO), pos


def match_call_head(text: str, pos: int) -> tuple[str, str, int]:
    """Match ``{"name": "NAME", "arguments": {`` (or ``"parameters"``, any whitespace) at
    ``text[pos:]``: (YES, NAME, index of the arguments' ``{``), or (PARTIAL | NO, "", pos)."""
    i = pos
    for literal in ("{", '"name"', ":", '"'):
        status, i = expect(text, i, literal)
        if status != YES:
            return status, "", pos
    end = _NAME.match(text, i).end()  # type: ignore[union-attr]
    name = text[i:end]
    if end == len(text):
        return PARTIAL, "", pos
    if text[end] != '"' or not name:
        return NO, "", pos
    status, i = expect(text, end + 1, ",")
    if status != YES:
        return status, "", pos
    results = [expect(text, i, key) for key in _ARGS_KEYS]
    hit = next((r for r in results if r[0] == YES), None)
    if hit is None:
        return (PARTIAL if any(r[0] == PARTIAL for r in results) else NO), "", pos
    status, i = expect(text, hit[1], ":")
    if status != YES:
        return status, "", pos
    i = skip_ws(text, i)
    if i == len(text):
        return PARTIAL, "", pos
    return (YES, name, i) if text[i] == "{" else (NO, "", pos)


class JsonScanner:
    """Finds where a JSON object or array ends, fed piece by piece. It checks brackets and
    strings only: a character JSON never has outside a string ends the value early (so a
    closing tag after malformed arguments is not swallowed)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = False
        self.escape = False

    def scan(self, text: str, pos: int = 0) -> tuple[int, bool] | None:
        """Scan ``text[pos:]``: (end, True) when the value closed at ``end`` (exclusive),
        (index, False) when an impossible character at ``index`` ended it, None when the text
        ran out first (the state carries over to the next call, which gets the next text)."""
        i, n = pos, len(text)
        while i < n:
            if self.in_string:
                if self.escape:
                    self.escape = False
                    i += 1
                    continue
                m = _IN_STRING.search(text, i)
                if m is None:
                    return None
                i = m.start()
                if text[i] == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                i += 1
                continue
            m = _OUTSIDE.search(text, i)
            if m is None:
                return None
            i = m.start()
            c = text[i]
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1, True
            else:
                return i, False
            i += 1
        return None


def decode_call(text: str, known: Callable[[str], bool]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call object in any key order, or None when it is not a call
    to a ``known`` name. Arguments may be an object or a JSON string holding one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if not known(obj["name"]):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


State = Callable[[], bool]


class CallStream(ToolCallStream):
    """Content handling and JSON call objects; a format subclass supplies the ``text`` state
    (and whatever states its markers need)."""

    def __init__(self, tools: Sequence[Tool] | None, id_factory: IdFactory) -> None:
        # None: any name (output the grammar already restricted to the tools)
        self.names = None if tools is None else frozenset(t.name for t in tools)
        self.id_factory = id_factory
        self.buf = ""
        self.final = False
        self.state: State = self.text
        self._out: list[StreamEvent] = []
        self._num_calls = 0
        # Whitespace touching a call is dropped, except that content before and after calls
        # stays separated by the whitespace that ended the content before them.
        self._held_ws = ""  # trailing whitespace of the content so far, not yet emitted
        self._gap = ""  # that whitespace, set aside when a call followed it
        self._has_content = False
        self._after_call = False
        # the call object being parsed: buf[:skip] is its marker, content if it fails
        self._skip = 0
        self._on_done: State = self.text
        self._on_fail: State = self.text
        self._outer = True  # the arguments sit inside a {"name": ..., ...} object
        self._scanner = JsonScanner()
        self._scan_pos = 0

    # ---- the loop ----

    def feed(self, text: str) -> list[StreamEvent]:
        if self.final:
            raise RuntimeError("feed() after finish()")
        self.buf += text
        self._run()
        return self._take()

    def finish(self) -> list[StreamEvent]:
        self.final = True
        self._run()
        assert not self.buf, f"{type(self).__name__} left {self.buf!r} undecided"
        if self._held_ws:
            self._out.append(ContentDelta(self._held_ws))
            self._held_ws = ""
        return self._take()

    def _run(self) -> None:
        while self.state():
            pass

    def _take(self) -> list[StreamEvent]:
        out, self._out = self._out, []
        return out

    def text(self) -> bool:
        raise NotImplementedError

    def known(self, name: str) -> bool:
        return self.names is None or name in self.names

    # ---- output ----

    def consume(self, n: int) -> str:
        taken, self.buf = self.buf[:n], self.buf[n:]
        return taken

    def content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(" \t\r\n")
            if not text:
                return
            self._after_call = False
            self._held_ws, self._gap = self._gap, ""
        body = text.rstrip(" \t\r\n")
        if body:
            self._out.append(ContentDelta(self._held_ws + body))
            self._held_ws = ""
            self._has_content = True
        self._held_ws += text[len(body) :]

    def content_until_marker(self, markers: Sequence[str]) -> tuple[bool, str | None]:
        """Emit the content before the first marker in ``buf`` (all of it, less a possible start
        of a marker at the end): (whether any was emitted, the marker now at ``buf[0]`` or
        None)."""
        i, marker = find_marker(self.buf, markers)
        if marker is None:
            i = len(self.buf) - (0 if self.final else held_back(self.buf, markers))
        if i:
            self.content(self.consume(i))
        return i > 0, marker

    def begin_call(self, name: str) -> None:
        if self._has_content and not self._after_call:
            self._gap = self._held_ws
        self._held_ws = ""
        self._after_call = False
        self._out.append(ToolCallDelta(self._num_calls, "", self.id_factory(), name))

    def arguments(self, piece: str) -> None:
        if piece:
            self._out.append(ToolCallDelta(self._num_calls, piece))

    def end_call(self) -> None:
        self._num_calls += 1
        self._after_call = True

    # ---- a JSON call object at buf[skip:] ----

    def start_object(self, skip: int, on_done: State, on_fail: State | None = None) -> bool:
        """Parse a call object after ``buf[:skip]`` (a marker, dropped when a call results and
        content when none does); then go to ``on_done`` (or ``on_fail``, default ``text``)."""
        self._skip = skip
        self._on_done = on_done
        self._on_fail = on_fail or self.text
        self.state = self._object_head
        return True

    def fail(self) -> bool:
        """The attempted call is none: its marker is content, parsing resumes after it."""
        if self._skip:
            self.content(self.consume(self._skip))
        self.state = self._on_fail
        return True

    def give_up(self, skip: int) -> bool:
        """No call at ``buf[0]``: ``buf[:skip]`` (its marker) is content, then ``text``."""
        self._skip, self._on_fail = skip, self.text
        return self.fail()

    def start_arguments(self, start: int, outer: bool, on_done: State) -> bool:
        """A call has begun and its arguments object starts at ``buf[start]``."""
        self.consume(start)
        self._outer = outer
        self._on_done = on_done
        self._scanner = JsonScanner()
        self.state = self._arguments
        return True

    def _object_head(self) -> bool:
        status, name, start = match_call_head(self.buf, self._skip)
        if status == PARTIAL and not self.final:
            return False
        if status == YES:
            if not self.known(name):
                return self.fail()
            self.begin_call(name)
            return self.start_arguments(start, True, self._on_done)
        # not the usual shape (other key order, string arguments, ...): the whole object
        i = skip_ws(self.buf, self._skip)
        if i == len(self.buf) or self.buf[i] != "{":
            return self.fail()
        self._scanner = JsonScanner()
        self._scan_pos = i
        self.state = self._whole_object
        return True

    def _whole_object(self) -> bool:
        begin = skip_ws(self.buf, self._skip)
        found = self._scanner.scan(self.buf, self._scan_pos)
        if found is None:
            self._scan_pos = len(self.buf)
            return self.fail() if self.final else False
        end, closed = found
        call = decode_call(self.buf[begin:end], self.known) if closed else None
        if call is None:
            return self.fail()
        self.consume(end)
        self.begin_call(call[0])
        self.arguments(call[1])
        self.end_call()
        self.state = self._on_done
        return True

    def _arguments(self) -> bool:
        if not self.buf:
            if self.final:  # cut off: the call keeps what it has
                self.end_call()
                self.state = self._on_done
                return True
            return False
        found = self._scanner.scan(self.buf)
        if found is None:
            self.arguments(self.consume(len(self.buf)))
            return True
        end, closed = found
        self.arguments(self.consume(end))
        if closed and self._outer:
            self._scanner = JsonScanner(depth=1)
            self.state = self._object_tail
        else:
            self.end_call()
            self.state = self._on_done
        return True

    def _object_tail(self) -> bool:
        """The rest of the call object after its arguments (normally just ``}``)."""
        if not self.buf:
            if self.final:
                self.end_call()
                self.state = self._on_done
                return True
            return False
        found = self._scanner.scan(self.buf)
        if found is None:
            self.consume(len(self.buf))
            return True
        self.consume(found[0])
        self.end_call()
        self.state = self._on_done
        return True

    # ---- a JSON array of call objects (Mistral's first format, tool_choice=required) ----

    def start_array(self, first: int, on_fail: State | None = None) -> bool:
        """``buf[first]`` is the ``{`` of the array's first element; ``buf[:first]`` (marker and
        ``[``) is content if that element is no call."""
        return self.start_object(first, self._array_next, on_fail)

    def _array_next(self) -> bool:
        """After an element: ``,`` and the next element, or ``]``; anything else is content."""
        i = skip_ws(self.buf, 0)
        if i == len(self.buf):
            if self.final:
                self.consume(i)
                self.state = self.text
                return True
            return False
        c = self.buf[i]
        if c == "]":
            self.consume(i + 1)
            self.state = self.text
            return True
        if c == ",":
            j = skip_ws(self.buf, i + 1)
            if j == len(self.buf) and not self.final:
                return False
            if j < len(self.buf) and self.buf[j] == "{":
                return self.start_object(j, self._array_next)
        self.state = self.text
        return True
