"""Request bodies: read with a size bound, parsed as JSON, and checked before any route looks at
them (depth, NaN / Infinity, text that is not valid Unicode), each problem a 400 that names
it."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request

from loom.server.errors import APIError, bad

logger = logging.getLogger(__name__)

# Deeper JSON than any request needs (a response_format schema nests a few levels per level of
# its data); deeper bodies are refused before anything recurses over them.
MAX_JSON_DEPTH = 64


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON, or a 400 naming what is wrong with it: not UTF-8, malformed,
    nested deeper than ``MAX_JSON_DEPTH``, a NaN or Infinity (not JSON, though Python's
    parser takes them), or text that is not valid Unicode (a lone surrogate such as
    ``"\\ud800"``, which has no UTF-8 form and fails tokenizers and chat templates)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text or "null")
    except RecursionError:
        raise bad(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        raise bad(f"malformed JSON body: {e}") from None
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Depth, finite numbers and valid Unicode everywhere in a parsed body (iteratively: no
    recursion over client data)."""
    if not isinstance(body, (dict, list)):
        return  # (a route refuses a body that is not an object)
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise bad(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", _top(path))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str):
                _check_str(key, path + (key,))
            t = type(value)
            if t is int or t is bool or value is None:
                continue
            if t is str:
                _check_str(value, path + (key,))
            elif t is float:
                if value != value or value in (float("inf"), float("-inf")):
                    literal = "NaN" if value != value else ("-" if value < 0 else "") + "Infinity"
                    raise bad(
                        f"{_where(path + (key,))}: {literal} is not a number JSON allows",
                        _top(path + (key,)),
                    )
            else:  # dict or list
                stack.append((value, path + (key,)))


def _check_str(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad_chars = s[e.start : e.end].encode("utf-8", "backslashreplace").decode()
        raise bad(
            f"{_where(path)} is not valid Unicode: {e.reason} at character {e.start} ({bad_chars})",
            _top(path),
        ) from None


def _top(path: tuple) -> str | None:
    return str(path[0])[:64] if path else None


def _where(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return (out or "body")[:200]


async def read_json_body(request: Request, limit: int) -> Any:
    """The body, read up to ``limit`` bytes (413 past it), parsed and checked by
    ``parse_json_body``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"the request body is larger than {limit} bytes", type_="invalid_request_error"
        )
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413,
                    f"the request body is larger than {limit} bytes",
                    type_="invalid_request_error",
                )
            chunks.append(chunk)
    except ClientDisconnect:
        logger.info(
            "client disconnected while sending the body of %s %s (%d bytes received)",
            request.method,
            request.url.path,
            size,
        )
        raise APIError(499, "client disconnected") from None
    return parse_json_body(b"".join(chunks))
