"""Tool calling for ``/v1/chat/completions``, independent of the HTTP routes.

- :mod:`.tools`: the request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked
  into a :class:`ToolRequest` (a :class:`ToolSpecError` names the bad field).
- :mod:`.base`: the ``tool_call_parser`` family's interface and the stream's events.
- :mod:`.formats`, :mod:`.pythonic`: the built-in parsers (hermes, llama3, mistral, pythonic);
  :mod:`.stream`: the machinery they share.
- :mod:`.parsers`: choosing one by name or, with ``auto``, from the chat template.
- :mod:`.grammar`: the schema the grammar backend enforces for ``tool_choice`` ``required``
  or a named function, and the calls of that constrained output.

A route, in short::

    tools, choice, parallel = parse_tool_fields(body.get("tools"), ...)  # ToolSpecError: 400
    schema = constraint_schema(tools, choice, parallel)       # None, or sampling's json_schema
    stream = constrained_streaming(tools, choice) or parser.streaming(tools)
    delta = openai_delta(stream.feed(text_piece))             # per piece; then stream.finish()

with ``parser = make_tool_call_parser(args.tool_call_parser, chat_template)`` made once.
"""

from __future__ import annotations

from loom.function_call.base import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    fold_events,
    new_call_id,
    openai_delta,
)
from loom.function_call.grammar import (
    calls_from_required,
    constrained_streaming,
    constraint_schema,
)
from loom.function_call.parsers import (
    AUTO,
    make_tool_call_parser,
    no_parser_message,
    parser_for_template,
)
from loom.function_call.tools import (
    Tool,
    ToolChoice,
    ToolRequest,
    ToolSpecError,
    parse_tool_fields,
)

__all__ = [
    "AUTO",
    "ContentDelta",
    "ParsedOutput",
    "StreamEvent",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStream",
    "ToolChoice",
    "ToolRequest",
    "ToolSpecError",
    "calls_from_required",
    "constrained_streaming",
    "constraint_schema",
    "fold_events",
    "make_tool_call_parser",
    "new_call_id",
    "no_parser_message",
    "openai_delta",
    "parse_tool_fields",
    "parser_for_template",
]
