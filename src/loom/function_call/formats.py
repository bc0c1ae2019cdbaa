"""The JSON tool-call formats: ``hermes`` (Qwen2.5, Qwen3, Hermes), ``llama3`` (Llama 3.1 and
3.2 JSON calls) and ``mistral`` (both of Mistral's formats).

Each call's arguments are streamed as the model writes them, from the ``{`` that opens them to
the ``}`` that closes them, so the concatenated pieces are the model's JSON text. A call whose
object has another shape (keys in another order, arguments as a JSON string) is found once the
object is complete, and its arguments are then re-serialised.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from loom.function_call.base import IdFactory, ToolCall, ToolCallParser, ToolCallStream
from loom.function_call.stream import CallStream, skip_ws
from loom.function_call.tools import Tool

_NAME = re.compile(r"[a-zA-Z0-9_-]*")
_CALL_ID = re.compile(r"[a-zA-Z0-9]*")


class HermesStream(CallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def text(self) -> bool:
        progress, marker = self.content_until_marker((self.OPEN,))
        if marker is None:
            return progress
        return self.start_object(len(self.OPEN), self._close)

    def _close(self) -> bool:
        i = skip_ws(self.buf, 0)
        rest = self.buf[i:]
        if rest.startswith(self.CLOSE):
            self.consume(i + len(self.CLOSE))
        elif not self.final and self.CLOSE.startswith(rest):
            return False
        self.state = self.text  # a missing closing tag is forgiven
        return True


class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call
    (Qwen2.5, Qwen3, NousResearch Hermes 2/3; ``"parameters"`` is accepted for
    ``"arguments"``)."""

    template_signals = ("<tool_call>",)
    template_priority = 30

    def detect(self, text: str) -> bool:
        return HermesStream.OPEN in text

    def streaming(self, tools: Sequence[Tool]) -> ToolCallStream:
        return HermesStream(tools, self.id_factory)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
            for c in calls
        )


class Llama3Stream(CallStream):
    TAG = "<|python_tag|>"

    def __init__(self, tools: Sequence[Tool], id_factory: IdFactory) -> None:
        super().__init__(tools, id_factory)
        self._at_start = True  # a call may open the output without the tag

    def text(self) -> bool:
        if self._at_start:
            i = skip_ws(self.buf, 0)
            if i == len(self.buf) and not self.final:
                return False
            self._at_start = False
            if i < len(self.buf) and self.buf[i] == "{":
                return self.start_object(0, self._next)
        progress, marker = self.content_until_marker((self.TAG,))
        if marker is None:
            return progress
        return self.start_object(len(self.TAG), self._next)

    def _next(self) -> bool:
        """After a call: another after ``;`` (or directly after whitespace), else content."""
        i = skip_ws(self.buf, 0)
        if i == len(self.buf) and not self.final:
            return False
        j = i
        if i < len(self.buf) and self.buf[i] == ";":
            j = skip_ws(self.buf, i + 1)
            if j == len(self.buf) and not self.final:
                return False
        if j < len(self.buf) and self.buf[j] == "{":
            return self.start_object(j, self._next)
        self.state = self.text
        return True


class Llama3Parser(ToolCallParser):
    """``{"name": "f", "parameters": {...}}`` (``"arguments"`` accepted too) opening the output
    or after ``<|python_tag|>``; several are separated by ``;``. Llama 3.1 and 3.2 with JSON
    tool calling."""

    template_signals = ("<|python_tag|>", '"parameters": dictionary of argument name')
    template_priority = 10

    def detect(self, text: str) -> bool:
        return Llama3Stream.TAG in text or text.lstrip().startswith("{")

    def streaming(self, tools: Sequence[Tool]) -> ToolCallStream:
        return Llama3Stream(tools, self.id_factory)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(f'{{"name": "{c.name}", "parameters": {c.arguments}}}' for c in calls)


class MistralStream(CallStream):
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def text(self) -> bool:
        progress, marker = self.content_until_marker((self.TAG,))
        if marker is None:
            return progress
        self.state = self._after_tag
        return True

    def _fail_tag(self) -> bool:
        return self.give_up(len(self.TAG))

    def _after_tag(self) -> bool:
        buf, final = self.buf, self.final
        i = skip_ws(buf, len(self.TAG))
        if i == len(buf):
            return self._fail_tag() if final else False
        if buf[i] == "[":  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
            j = skip_ws(buf, i + 1)
            if j == len(buf) and not final:
                return False
            if j < len(buf) and buf[j] == "{":
                return self.start_array(j)
            return self._fail_tag()
        if buf[i] == "{":  # a lone object
            return self.start_object(i, self.text)
        # [TOOL_CALLS]name[ARGS]{...}, maybe with [CALL_ID]id before [ARGS], or no [ARGS] at
        # all when the tokenizer dropped the control token from the text
        end = _NAME.match(buf, i).end()  # type: ignore[union-attr]
        name = buf[i:end]
        if end == len(buf):
            return self._fail_tag() if final else False
        rest = buf[end:]
        if rest.startswith(self.CALL_ID):
            k = _CALL_ID.match(buf, end + len(self.CALL_ID)).end()  # type: ignore[union-attr]
            end, rest = k, buf[k:]
            if not rest.startswith(self.ARGS):
                return False if not final and self.ARGS.startswith(rest) else self._fail_tag()
        if rest.startswith(self.ARGS):
            start = end + len(self.ARGS)
        elif rest.startswith("{"):
            start = end
        elif not final and (self.ARGS.startswith(rest) or self.CALL_ID.startswith(rest)):
            return False
        else:
            return self._fail_tag()
        start = skip_ws(buf, start)
        if start == len(buf):
            return self._fail_tag() if final else False
        if buf[start] != "{" or not self.known(name):
            return self._fail_tag()
        self.begin_call(name)
        return self.start_arguments(start, False, self.text)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (Mistral 7B v0.3, Mixtral,
    tokenizer < v11) and ``[TOOL_CALLS]f[ARGS]{...}`` repeated per call (Mistral Small 3.1+,
    tokenizer >= v11; ``[CALL_ID]id`` before ``[ARGS]`` is accepted, the id ignored).
    ``[TOOL_CALLS]`` is a special token: the output must be detokenized with it kept."""

    template_signals = ("[TOOL_CALLS]",)
    template_priority = 30

    def detect(self, text: str) -> bool:
        return MistralStream.TAG in text

    def streaming(self, tools: Sequence[Tool]) -> ToolCallStream:
        return MistralStream(tools, self.id_factory)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        return "".join(f"[TOOL_CALLS]{c.name}[ARGS]{c.arguments}" for c in calls)
