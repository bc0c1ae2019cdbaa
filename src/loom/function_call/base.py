"""The tool_call_parser family: find tool calls in what a model generated.

A model trained for tool use writes its calls in its own format (``<tool_call>{...}</tool_call>``
for Qwen, ``[TOOL_CALLS]`` for Mistral, ...). A parser turns generated text into content plus
:class:`ToolCall`s, once for a whole output (:meth:`ToolCallParser.parse`) or incrementally
while it streams (:meth:`ToolCallParser.streaming`), in OpenAI's streamed shape.

Contract of a member (checked by ``loom.testing.check_tool_call_parser``):

- ``parse(text, tools)`` equals folding the events of one stream fed ``text`` in any pieces:
  ``fold_events(s.feed(a) + s.feed(b) + ... + s.finish())`` for every split of ``text``.
- A stream never emits text it may later take back: a possible start of a call marker is held
  until it is known not to be one, so no fragment of a marker reaches content.
- A call's first :class:`ToolCallDelta` has ``id`` and ``name``; later ones only add
  ``arguments`` pieces; indices count 0, 1, ... in order. A call starts only once its name is
  complete and names one of ``tools``: a call to an unknown function, or text that is not a
  well-formed call, stays content, exactly as generated. So when no call is found, content is
  the text unchanged.
- Text before, between and after calls is content; whitespace next to a call is dropped.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from loom.function_call.tools import Tool

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's shape of a tool-call id: ``call_`` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


IdFactory = Callable[[], str]


@dataclass(frozen=True)
class ToolCall:
    """A complete call; ``arguments`` is a JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = ""

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ContentDelta:
    """A piece of the message's ``content``."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first has ``id`` and ``name`` (and maybe arguments), later
    ones append to ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """An entry of a streamed chunk's ``delta.tool_calls``."""
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        out["function"] = fn
        return out


StreamEvent = ContentDelta | ToolCallDelta


class ParsedOutput(NamedTuple):
    content: str
    calls: list[ToolCall]


def fold_events(events: Sequence[StreamEvent]) -> ParsedOutput:
    """The whole output a sequence of stream events describes."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
            continue
        if e.index == len(calls):
            calls.append({"id": e.id or "", "name": e.name or "", "arguments": []})
        calls[e.index]["arguments"].append(e.arguments)
    return ParsedOutput(
        "".join(content),
        [ToolCall(c["name"], "".join(c["arguments"]), c["id"]) for c in calls],
    )


def openai_delta(events: Sequence[StreamEvent]) -> dict[str, Any]:
    """One streamed chunk's ``delta`` for ``events`` (``{}`` when there is nothing to send):
    the content pieces joined, consecutive pieces of one call merged."""
    delta: dict[str, Any] = {}
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    if text:
        delta["content"] = text
    calls: list[dict[str, Any]] = []
    for e in events:
        if not isinstance(e, ToolCallDelta):
            continue
        if calls and calls[-1]["index"] == e.index and e.id is None:
            calls[-1]["function"]["arguments"] += e.arguments
        else:
            calls.append(e.openai())
    if calls:
        delta["tool_calls"] = calls
    return delta


class ToolCallStream(ABC):
    """Parses one output as it is generated. ``feed`` may be called any number of times, then
    ``finish`` once (it flushes what was held back and ends a call cut off by the end)."""

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]: ...

    @abstractmethod
    def finish(self) -> list[StreamEvent]: ...


class ToolCallParser(ABC):
    """A model family's tool-call format. Instances hold no per-output state (a stream does), so
    one serves every request. ``id_factory`` makes the call ids (:func:`new_call_id`).

    ``--tool-call-parser auto`` takes the registered parser with the highest
    :meth:`template_score` for the model's chat template; the default scores
    ``template_priority`` when any of ``template_signals`` occurs in the template's source.
    """

    template_signals: ClassVar[tuple[str, ...]] = ()
    template_priority: ClassVar[int] = 0

    def __init__(self, id_factory: IdFactory = new_call_id) -> None:
        self.id_factory = id_factory

    @abstractmethod
    def detect(self, text: str) -> bool:
        """Whether ``text`` may hold a call (cheap; a True may still parse to no call)."""

    @abstractmethod
    def streaming(self, tools: Sequence[Tool]) -> ToolCallStream:
        """A stream for one output that may call ``tools``."""

    def parse(self, text: str, tools: Sequence[Tool]) -> ParsedOutput:
        """Content and calls of a complete output."""
        s = self.streaming(tools)
        return fold_events([*s.feed(text), *s.finish()])

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """``calls`` written as the model writes them (tests and the conformance kit use it to
        check that ``parse`` finds them again). Optional."""
        raise NotImplementedError

    @classmethod
    def template_score(cls, template: str) -> int | None:
        """How surely a chat template is this format's (higher wins), None when it is not."""
        if any(s in template for s in cls.template_signals):
            return cls.template_priority
        return None
