"""Errors in OpenAI's shape: ``APIError``, the handlers that answer every failure with it (an
unknown route and an unhandled exception included), and the API-key guard."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.sampling.limits import ParamError

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"^([a-z_]+)[ :]")


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


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def value_error(e: ValueError, names: dict[str, str] | None = None) -> APIError:
    """A validation error as a 400; ``names`` maps Loom's field names to the request's own
    (OpenAI's ``max_tokens`` for ``max_new_tokens``)."""
    import dataclasses

    from loom.sampling.sampling_params import SamplingParams

    msg = str(e)
    if isinstance(e, ParamError):
        return bad(msg, (names or {}).get(e.param, e.param))
    m = _FIELD.match(msg)
    fields = {f.name for f in dataclasses.fields(SamplingParams)} | {
        "prompt",
        "input_ids",
        "messages",
        "custom_logit_processor",
    }
    return bad(msg, m.group(1) if m and m.group(1) in fields else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        # unknown routes (404), wrong methods (405): OpenAI's shape like every other error
        return error_response(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.error(
            "%s %s failed: %s: %s",
            request.method,
            request.url.path,
            type(err).__name__,
            err,
            exc_info=err,
        )
        return error_response(APIError(500, f"internal error: {type(err).__name__}: {err}"))


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from handlers)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != self.expected:
                err = APIError(401, "missing or wrong API key (Authorization: Bearer <key>)")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
