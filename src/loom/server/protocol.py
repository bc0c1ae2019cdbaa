"""Request parsing for the OpenAI routes: every field is known, type-checked and range-checked,
and turned into Loom's sampling parameters. Unknown fields and fields whose feature has not landed
yet are refused with a 400 that names them: nothing is silently ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class APIError(Exception):
    """An error with an HTTP status, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            503: "service_unavailable",
        }.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# Fields whose feature arrives with a later issue: accepted by name, refused unless neutral.
_LATER = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "suffix": (None, ""),
}
# Metadata that does not change generation.
_METADATA = {"user", "metadata", "store", "service_tier", "stream_options", "rid"}


def _num(
    body: dict,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    integer: bool = False,
) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise bad(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}", name)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise bad(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise bad(f"{name} must be <= {hi}, got {value}", name)
    return value


@dataclass
class ParsedRequest:
    model: str | None
    n: int
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]  # Loom sampling params (SGLang names)
    priority: int | None = None
    extra_key: str | None = None  # OpenAI's cache_salt: a prefix-cache namespace
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False  # completions: the prompt is returned before the completion
    best_of: int = 1  # completions: samples per prompt, the n best returned
    lora: str | None = None  # a LoRA adapter's name (``lora_path``, or the model "BASE:NAME")


def _constraints(body: dict[str, Any], sampling: dict[str, Any]) -> None:
    """OpenAI ``response_format`` and the ``regex`` / ``ebnf`` extra fields -> one constraint."""
    given = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad('response_format must be an object with a "type"', "response_format")
        kind = fmt["type"]
        if kind == "json_object":
            sampling["json_schema"] = '{"type": "object"}'
            given.append("response_format")
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad(
                    'response_format json_schema needs {"json_schema": {"name": ..., '
                    '"schema": {...}}}',
                    "response_format",
                )
            sampling["json_schema"] = json.dumps(schema)
            given.append("response_format")
        elif kind == "structural_tag":
            sampling["structural_tag"] = json.dumps(fmt)
            given.append("response_format")
        elif kind != "text":
            raise bad(f"unknown response_format type {kind!r}", "response_format")
    for key in ("regex", "ebnf"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise bad(f"{key} must be a non-empty string", key)
            sampling[key] = value
            given.append(key)
    if len(given) > 1:
        raise bad(
            f"at most one of response_format, regex, ebnf per request, got {', '.join(given)}",
            given[-1],
        )


def parse_common(body: dict[str, Any], known: set[str]) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    allowed = (
        known
        | set(_LATER)
        | _METADATA
        | {
            "model",
            "n",
            "stream",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "stop",
            "seed",
            "top_k",
            "min_p",
            "ignore_eos",
            "skip_special_tokens",
            "stop_token_ids",
            "custom_logit_processor",
            "custom_params",
            "no_stop_trim",
            "priority",
            "cache_salt",
            "lora_path",
            "response_format",
            "regex",
            "ebnf",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "logit_bias",
            "min_tokens",
            "logprobs",
            "top_logprobs",
        }
    )
    for key in body:
        if key not in allowed:
            raise bad(f"unknown field {key!r}", key)
    for key, neutral in _LATER.items():
        if key in body and body[key] not in neutral:
            raise bad(f"{key} is not supported yet", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    n = _num(body, "n", 1, 64, integer=True) or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    if opts and not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    sampling: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        sampling["max_new_tokens"] = _num(body, key, 1, integer=True)
    if (t := _num(body, "temperature", 0, 2)) is not None:
        sampling["temperature"] = t
    if (p := _num(body, "top_p", 0, 1, lo_open=True)) is not None:
        sampling["top_p"] = p
    if (k := _num(body, "top_k", integer=True)) is not None:
        if k == 0 or k < -1:
            raise bad(f"top_k must be -1 or >= 1, got {k}", "top_k")
        sampling["top_k"] = k
    if (m := _num(body, "min_p", 0, 1)) is not None:
        sampling["min_p"] = m
    if (seed := _num(body, "seed", integer=True)) is not None:
        sampling["sampling_seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop must be a string or a list of non-empty strings", "stop")
        sampling["stop"] = stops
    for key in ("ignore_eos", "skip_special_tokens"):
        if key in body:
            if not isinstance(body[key], bool):
                raise bad(f"{key} must be a boolean", key)
            sampling[key] = body[key]
    if "stop_token_ids" in body:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise bad("stop_token_ids must be a list of integers", "stop_token_ids")
        sampling["stop_token_ids"] = ids
    for key in ("custom_logit_processor", "custom_params"):
        if body.get(key) is not None:
            sampling[key] = body[key]
    _constraints(body, sampling)
    for key in ("frequency_penalty", "presence_penalty"):
        if (v := _num(body, key, -2, 2)) is not None:
            sampling[key] = v
    if (v := _num(body, "repetition_penalty", 0, 2, lo_open=True)) is not None:
        sampling["repetition_penalty"] = v
    if (v := _num(body, "min_tokens", 0, integer=True)) is not None:
        sampling["min_new_tokens"] = v
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias must map token ids to numbers", "logit_bias")
        out = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise bad(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise bad(f"logit_bias[{k}] must be a number in [-100, 100]", "logit_bias")
            out[tok] = v
        sampling["logit_bias"] = out
    logprobs, top = _logprobs(body, chat="messages" in known)
    priority = _num(body, "priority", integer=True)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("cache_salt must be a non-empty string", "cache_salt")
    lora = body.get("lora_path")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise bad("lora_path must be an adapter name (a non-empty string)", "lora_path")
    req = ParsedRequest(
        model, n, stream, bool(opts.get("include_usage")), sampling, priority, salt, logprobs, top
    )
    req.lora = lora
    return req


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0-20); completions: ``logprobs`` (0-5)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise bad("logprobs must be a boolean", "logprobs")
        top = _num(body, "top_logprobs", 0, 20, integer=True)
        if top and not value:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        return bool(value), top or 0
    if "top_logprobs" in body:
        raise bad("top_logprobs is a chat field; completions take logprobs=N", "top_logprobs")
    if value is None or value is False:
        return False, 0
    n = _num(body, "logprobs", 0, 5, integer=True)
    return True, n


def parse_chat(body: dict[str, Any]) -> tuple[ParsedRequest, list[dict[str, Any]]]:
    req = parse_common(body, {"messages"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in (
            "system",
            "user",
            "assistant",
            "developer",
            "tool",
        ):
            raise bad(
                f"messages[{i}] needs a role of system, user, assistant, developer or tool",
                "messages",
            )
        content = msg.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        role = "system" if msg["role"] == "developer" else msg["role"]
        out.append({"role": role, "content": content})
    return req, out


def parse_completion(body: dict[str, Any]) -> tuple[ParsedRequest, list[str | list[int]]]:
    req = parse_common(body, {"prompt", "echo", "best_of"})
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo must be a boolean", "echo")
    req.echo = bool(echo)
    best_of = _num(body, "best_of", 1, 20, integer=True)
    if best_of is not None:
        if best_of < req.n:
            raise bad(f"best_of must be >= n ({req.n}), got {best_of}", "best_of")
        if req.stream and best_of > req.n:
            raise bad("best_of > n cannot be streamed", "best_of")
        req.best_of = best_of
    req.best_of = max(req.best_of, req.n)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p))
            for p in prompt
        )
    ):
        prompts = list(prompt)
    else:
        raise bad(
            "prompt must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists",
            "prompt",
        )
    if any(len(p) == 0 for p in prompts):
        raise bad("prompt must not be empty", "prompt")
    return req, prompts


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))
