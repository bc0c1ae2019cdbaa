"""``/v1/chat/completions``: messages through the chat template (with the request's tools),
and each answer split into what OpenAI's API returns: ``reasoning_content`` (with
``--reasoning-parser``), ``content`` and ``tool_calls``.

Tool calls come three ways, by ``tool_choice``:
- ``auto``: the model writes calls in the format it was trained on; the ``tool_call_parser``
  (``--tool-call-parser``, by default the one the chat template renders) finds them, and the
  text around them stays content.
- a named function: the grammar backend constrains the output to that function's parameters
  (the output is the arguments), so they always parse and validate.
- ``required``: constrained to a JSON list of calls to the given functions (one call unless
  ``parallel_tool_calls``).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from loom.function_call import (
    ContentDelta,
    ToolCallStream,
    ToolChoice,
    ToolSpecError,
    constrained_streaming,
    constraint_schema,
    make_tool_call_parser,
    no_parser_message,
    parse_tool_fields,
)
from loom.reasoning import REASONING_FORMATS, ReasoningParser, starts_in_reasoning
from loom.server.context import ServerContext
from loom.server.errors import bad, value_error
from loom.server.openai_routes import chat_logprobs, usage
from loom.server.protocol import ParsedRequest, finish_reason, output_error, parse_common
from loom.server.schemas import ChatCompletionRequest, fields_of, openapi
from loom.server.streaming import chained, collect, first_of, stream_response

_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class ChatRequest:
    req: ParsedRequest
    messages: list[dict[str, Any]]
    tools: list = field(default_factory=list)  # loom.function_call.tools.Tool
    choice: ToolChoice | None = None
    parallel: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    separate_reasoning: bool = True


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}: a text part needs a string text", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise bad(f"{where} must be a string or a list of text parts", "messages")
    return content


def _history_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's earlier tool call, for the template: arguments as an object
    (templates render them with ``tojson``) when they are JSON, else the string."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} needs a function with a name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise bad(f"{where} needs a role of {', '.join(_ROLES)}", "messages")
        role = "system" if msg["role"] == "developer" else msg["role"]
        calls = msg.get("tool_calls")
        content = msg.get("content")
        if role == "assistant" and content is None and calls:
            content = ""  # OpenAI: an assistant turn that only called tools
        item: dict[str, Any] = {"role": role, "content": _text(content, f"{where}.content")}
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls: a list, on assistant messages only", "messages")
            item["tool_calls"] = [
                _history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
            ]
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id must be a string", "messages")
            item["tool_call_id"] = call_id
        for key in ("name", "reasoning_content"):
            if isinstance(msg.get(key), str):
                item[key] = msg[key]
        out.append(item)
    return out


def parse_chat(body: Any) -> ChatRequest:
    body = fields_of(ChatCompletionRequest, body)
    req = parse_common(body, chat=True)
    chat = ChatRequest(req, parse_messages(body.get("messages")))
    try:
        chat.tools, chat.choice, chat.parallel = parse_tool_fields(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
    except ToolSpecError as e:
        raise bad(str(e), e.param) from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
    chat.template_kwargs = kwargs or {}
    separate = body.get("separate_reasoning", True)
    if not isinstance(separate, bool):
        raise bad("separate_reasoning must be a boolean", "separate_reasoning")
    chat.separate_reasoning = separate
    schema = constraint_schema(chat.tools, chat.choice, chat.parallel)
    if schema is not None:
        given = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in req.sampling]
        if given:
            raise bad(
                f"tool_choice {chat.choice.describe()} constrains the output itself; it cannot "
                "be combined with response_format, regex or ebnf",
                "tool_choice",
            )
        req.sampling["json_schema"] = json.dumps(schema)
    return chat


class _Choice:
    """One answer's text, split as it arrives into OpenAI's delta fields."""

    def __init__(self, chat: ChatRequest, reasoning: ReasoningParser | None, parser) -> None:
        self.reasoning = reasoning
        self.mode = chat.choice.mode if chat.tools else "none"
        self.calls: ToolCallStream | None = None
        if self.mode in ("named", "required"):
            self.calls = constrained_streaming(chat.tools, chat.choice)
        elif self.mode == "auto":
            self.calls = parser.streaming(chat.tools)
        self.num_calls = 0

    def feed(self, delta: str, final: bool) -> list[dict[str, Any]]:
        """The deltas ``delta`` releases (each a chunk's ``delta`` object), in order."""
        thought = ""
        if self.reasoning is not None:
            thought, delta = self.reasoning.feed(delta)
            if final:
                more_thought, more = self.reasoning.finish()
                thought, delta = thought + more_thought, delta + more
        out: list[dict[str, Any]] = []
        if thought:
            out.append({"reasoning_content": thought})
        if self.calls is None:
            if delta:
                out.append({"content": delta})
            return out
        events = self.calls.feed(delta) if delta else []
        if final:
            events += self.calls.finish()
        for ev in events:
            if isinstance(ev, ContentDelta):
                if ev.text:
                    out.append({"content": ev.text})
            else:
                self.num_calls = max(self.num_calls, ev.index + 1)
                out.append({"tool_calls": [ev.openai()]})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call (auto, required); a named
        # tool_choice ends with "stop"
        if reason == "stop" and self.num_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _message(deltas: list[dict[str, Any]], with_reasoning: bool) -> dict[str, Any]:
    """A whole answer's message from its deltas."""
    content = "".join(d.get("content", "") for d in deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"].get("arguments", "")
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if with_reasoning:
        msg["reasoning_content"] = thought or None
    if calls:
        msg["tool_calls"] = calls
    return msg


def router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    sse = ctx.sse
    engine, args, model_name = ctx.engine, ctx.args, ctx.model_name
    fmt = REASONING_FORMATS.get(args.reasoning_parser or "")

    parsers: dict[str, Any] = {}

    def parser_of(chat: ChatRequest):
        """The tool-call parser of an ``auto`` request: the flag's, or the template's."""
        if not chat.tools or chat.choice.mode != "auto":
            return None
        template = engine.tokenizer_manager.chat_template
        if args.tool_call_parser not in parsers:
            try:
                parsers[args.tool_call_parser] = make_tool_call_parser(
                    args.tool_call_parser, template
                )
            except ValueError:
                raise bad(
                    f"tool_choice auto: {no_parser_message(template)}; or use tool_choice "
                    "required or a named function",
                    "tool_choice",
                ) from None
        return parsers[args.tool_call_parser]

    @router.post("/v1/chat/completions", openapi_extra=openapi(ChatCompletionRequest))
    async def chat_completions(request: Request):
        chat = parse_chat(await ctx.body(request))
        req = chat.req
        ctx.check_model(req)
        tm = engine.tokenizer_manager
        if tm is None:
            raise bad("chat needs a tokenizer (the server started with --skip-tokenizer-init)")
        try:
            prompt = tm.render_chat(
                chat.messages, [t.openai() for t in chat.tools], chat.template_kwargs
            )
        except ValueError as e:
            raise value_error(e) from e
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        parser = parser_of(chat)
        if parser is not None and "skip_special_tokens" not in req.sampling:
            # Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens
            req.sampling["skip_special_tokens"] = False
        thinking = fmt is not None and chat.separate_reasoning
        in_reasoning = thinking and starts_in_reasoning(fmt, prompt)

        def choice() -> _Choice:
            return _Choice(chat, ReasoningParser(fmt, in_reasoning) if thinking else None, parser)

        ctx.admit(req.n)
        streams = await ctx.start(ids, None, req.sampling, req, n=req.n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": model_name}
        if not req.stream:
            results = await collect(request, streams)
            choices = []
            for i, r in enumerate(results):
                c = choice()
                msg = _message(c.feed(r["text"], final=True), thinking)
                reason = finish_reason(r["meta_info"].get("finish_reason"))
                choices.append(
                    {
                        "index": i,
                        "message": msg,
                        "finish_reason": c.finish_reason(reason),
                        "logprobs": chat_logprobs(r["logprobs"], r["top"])
                        if req.logprobs
                        else None,
                    }
                )
            return {
                **base,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage([r["meta_info"] for r in results], req.n),
            }

        first, rest = await first_of(request, streams)
        states = [choice() for _ in streams]

        async def events():
            chunk = {**base, "object": "chat.completion.chunk"}

            def one(i: int, delta: dict[str, Any], reason=None, logprobs=None) -> bytes:
                c: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": reason}
                if logprobs is not None:
                    c["logprobs"] = logprobs
                return sse({**chunk, "choices": [c]})

            for i in range(req.n):
                yield one(i, {"role": "assistant", "content": ""})
            metas: list[dict[str, Any]] = [{} for _ in streams]
            async for i, inc in chained(first, rest):
                meta = metas[i] = inc["meta_info"]
                reason = finish_reason(meta.get("finish_reason"))
                lp = None
                if req.logprobs and meta.get("output_token_logprobs"):
                    lp = chat_logprobs(
                        meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", [])
                    )
                deltas = states[i].feed(inc["text"], final=reason is not None)
                for k, delta in enumerate(deltas):
                    yield one(i, delta, logprobs=lp if k == 0 else None)
                if lp is not None and not deltas:
                    yield one(i, {}, logprobs=lp)
                if reason is not None:
                    yield one(i, {}, states[i].finish_reason(reason))
                if (err := output_error(meta)) is not None:
                    yield sse(err.body())
            if req.include_usage:
                yield sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    return router
