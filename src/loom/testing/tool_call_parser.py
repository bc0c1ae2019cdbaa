"""Conformance kit of the tool_call_parser family."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Sequence

from loom import plugins
from loom.function_call.base import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    fold_events,
)
from loom.function_call.tools import Tool, parse_tools
from loom.testing.tools import TOOL_DEFS, ToolDef

# Text no format should take for a call: prose, code, brackets and braces, and beginnings of
# the built-in formats' markers.
PLAIN_TEXTS = [
    "",
    "The capital of France is Paris.",
    "  Leading and trailing whitespace \n\n",
    "Unicode: 東京 — café — 🙂\n",
    "Use a list: x = [1, 2, 3]; y = {'a': 1}\n```python\nprint(x)\n```",
    "A tag that never closes: <tool",
    "Almost a marker: [TOOL_CALL and <|python_ta and <tool_cal> and <|python_st",
    'JSON in prose: the object {"name": "x"} has one key.',
]


def make(name: str) -> tuple[ToolCallParser, Callable[[], None]]:
    """A parser whose ids are ``call_0``, ``call_1``, ... (reset by calling the second item)."""
    ids = itertools.count()
    state = {"ids": ids}

    def factory() -> str:
        return f"call_{next(state['ids'])}"

    def reset() -> None:
        state["ids"] = itertools.count()

    target = plugins.resolve("tool_call_parser", name)
    parser = target(id_factory=factory)
    assert isinstance(parser, ToolCallParser), f"{name}: not a ToolCallParser"
    return parser, reset


def splits(text: str) -> Iterable[list[str]]:
    """``text`` whole, character by character, and cut in two at every point."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def stream_events(parser: ToolCallParser, pieces: Sequence[str], tools) -> list[StreamEvent]:
    s = parser.streaming(tools)
    events: list[StreamEvent] = []
    for p in pieces:
        events += s.feed(p)
    return events + s.finish()


def check_events(name: str, events: Sequence[StreamEvent]) -> None:
    """The streamed shape: a call's first delta has id and name, later ones neither; indices
    count up from 0; no empty content pieces."""
    seen = -1
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text, f"{name}: an empty content delta"
            continue
        assert isinstance(e, ToolCallDelta), f"{name}: unknown event {e!r}"
        if e.index == seen + 1:
            assert e.id and e.name, f"{name}: call {e.index}'s first delta needs id and name"
            seen = e.index
        else:
            assert e.index == seen, f"{name}: call indices must count up ({e!r})"
            assert e.id is None and e.name is None, f"{name}: id and name come once ({e!r})"


def check_streaming(
    name: str, text: str, tools: Sequence[Tool], parser: ToolCallParser, reset
) -> ParsedOutput:
    """Every split of ``text`` streams to what ``parse`` gives; returns that."""
    reset()
    whole = parser.parse(text, tools)
    for pieces in splits(text):
        reset()
        events = stream_events(parser, pieces, tools)
        check_events(name, events)
        got = fold_events(events)
        assert got == whole, (
            f"{name}: streaming {[p for p in pieces]!r} gave {got!r}, parse gave {whole!r}"
        )
    return whole


def _calls(defs: Sequence[ToolDef]) -> list[ToolCall]:
    return [
        ToolCall(d.name, json.dumps(d.valid, ensure_ascii=False), f"call_{i}")
        for i, d in enumerate(defs)
    ]


def check_tool_call_parser(name: str, tool_defs: Sequence[ToolDef] = TOOL_DEFS) -> None:
    """Plain text stays content, unchanged; when the parser implements ``format_calls``, calls
    to each tool (alone, and three in a row) parse back exactly, and a call to a function not
    among the tools stays content; every split of every text streams to what ``parse`` gives,
    in OpenAI's streamed shape."""
    parser, reset = make(name)
    tools = parse_tools([d.tool for d in tool_defs])
    for text in PLAIN_TEXTS:
        got = check_streaming(name, text, tools, parser, reset)
        assert got == ParsedOutput(text, []), f"{name}: {text!r} is no call, got {got!r}"
    try:
        parser.format_calls(_calls(tool_defs[:1]))
    except NotImplementedError:
        return
    groups = [[d] for d in tool_defs] + [list(tool_defs[i : i + 3]) for i in (0, 7, 14)]
    for group in groups:
        calls = _calls(group)
        text = parser.format_calls(calls)
        assert parser.detect(text), f"{name}: detect() misses {text!r}"
        got = check_streaming(name, text, tools, parser, reset)
        assert got.content == "", f"{name}: {text!r} left content {got.content!r}"
        assert [(c.id, c.name) for c in got.calls] == [(c.id, c.name) for c in calls], (
            f"{name}: {text!r} gave calls {got.calls!r}"
        )
        for call, d in zip(got.calls, group, strict=True):
            assert json.loads(call.arguments) == d.valid, (
                f"{name}: {d.name}'s arguments came back as {call.arguments!r}"
            )
        others = [t for t in tools if t.name not in {d.name for d in group}]
        got = check_streaming(name, text, others, parser, reset)
        assert got == ParsedOutput(text, []), (
            f"{name}: a call to a function not among the tools must stay content, got {got!r}"
        )
