"""Request parsing for the OpenAI routes: every field is known (``schemas.py``), type-checked and
range-checked, and turned into Loom's sampling parameters. Unknown fields and fields whose
feature has not landed yet are refused with a 400 that names them: nothing is silently
ignored."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loom.sampling.limits import OPENAI_NAMES, ParamError, check_number
from loom.sampling.sampling_params import SamplingParams
from loom.server.errors import APIError, bad
from loom.server.schemas import CompletionRequest, fields_of

# Fields whose feature arrives with a later issue: accepted by name, refused unless neutral.
_LATER = {
    "suffix": (None, ""),
}
# OpenAI (and SGLang-extension) sampling fields, checked by SamplingParams under Loom's names;
# max_completion_tokens after max_tokens: the newer name wins when both are given.
_SAMPLING_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_regex",
    "stream_interval",
    "ignore_eos",
    "skip_special_tokens",
    "stop_token_ids",
    "custom_logit_processor",
    "custom_params",
    "no_stop_trim",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
)


def _num(body: dict, name: str, bound: str | None = None) -> Any:
    """``body[name]`` checked against ``limits.BOUNDS[bound or name]`` (None if absent)."""
    value = body.get(name)
    if value is None:
        return None
    try:
        return check_number(bound or name, value, name)
    except ParamError as e:
        raise bad(str(e), name) from None


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
    names: dict[str, str] = field(default_factory=dict)  # Loom's field name -> the request's


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


def parse_common(body: dict[str, Any], chat: bool) -> ParsedRequest:
    """The fields chat and completions share (``body``: its fields, checked against the
    route's schema)."""
    for key, neutral in _LATER.items():
        if key in body and body[key] not in neutral:
            raise bad(f"{key} is not supported yet", key)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    n = _num(body, "n") or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    if opts and not stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    # Sampling fields go to SamplingParams under Loom's names and are checked there, once,
    # with errors naming the field as this request spelled it.
    sampling: dict[str, Any] = {}
    names: dict[str, str] = {}
    for key in _SAMPLING_FIELDS:
        if body.get(key) is not None:
            loom = OPENAI_NAMES.get(key, key)
            sampling[loom] = body[key]
            names[loom] = key
    _constraints(body, sampling)
    try:
        SamplingParams.from_dict(sampling, names)
    except ParamError as e:
        raise bad(str(e), e.param) from None
    except ValueError as e:
        raise bad(str(e)) from None
    if sampling.get("max_new_tokens") == 0:  # OpenAI's minimum (Loom's own API allows 0)
        key = names["max_new_tokens"]
        raise bad(f"{key} must be an integer >= 1, got 0", key)
    logprobs, top = _logprobs(body, chat=chat)
    priority = _num(body, "priority")
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
    req.names = names
    return req


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0-20); completions: ``logprobs`` (0-5)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise bad("logprobs must be a boolean", "logprobs")
        top = _num(body, "top_logprobs", "top_logprobs_num")
        if top and not value:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        return bool(value), top or 0
    if "top_logprobs" in body:
        raise bad("top_logprobs is a chat field; completions take logprobs=N", "top_logprobs")
    if value is None or value is False:
        return False, 0
    return True, _num(body, "logprobs", "completion_logprobs")


def parse_completion(body: Any) -> tuple[ParsedRequest, list[str | list[int]]]:
    body = fields_of(CompletionRequest, body)
    req = parse_common(body, chat=False)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo must be a boolean", "echo")
    req.echo = bool(echo)
    best_of = _num(body, "best_of")
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
    """OpenAI's finish_reason: a request that failed (its reason carries a status code) ends
    with ``"error"``; a client's abort with ``"abort"``."""
    if reason is None:
        return None
    if reason.get("status_code") is not None:
        return "error"
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))


def output_error(meta: dict[str, Any]) -> APIError | None:
    """The error of a request that failed after submission (in the scheduler, or the scheduler
    itself), from its last ``meta_info``; None if it did not fail."""
    if meta.get("error") is None:
        return None
    reason = meta.get("finish_reason") or {}
    status = reason.get("status_code") or 500
    return APIError(status, str(meta["error"]), reason.get("param"))
