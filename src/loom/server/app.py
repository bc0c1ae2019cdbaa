"""The HTTP server: OpenAI-compatible routes under /v1, SGLang's native routes, /metrics.

The app holds the front end (an ``Engine`` whose scheduler runs in its own process); handlers only
tokenise, submit, and stream increments back, so one slow or bad request never blocks others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from loom.sampling.limits import ParamError, show
from loom.server.protocol import (
    APIError,
    ParsedRequest,
    bad,
    finish_reason,
    output_error,
    parse_chat,
    parse_completion,
    parse_json_body,
)

if TYPE_CHECKING:
    from loom.engine.engine import Engine

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"^([a-z_]+)[ :]")


def _decode(engine, ids: list[int]) -> str:
    tok = engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


def _mean_logprob(r: dict[str, Any]) -> float:
    lps = [lp for lp, _, _ in r["logprobs"] if lp is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


def chat_logprobs(entries: list, tops: list) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` from Loom's (logprob, id, text) entries."""

    def one(lp, text):
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for k, (lp, _, text) in enumerate(entries):
        item = one(lp, text)
        item["top_logprobs"] = [
            one(t_lp, t_text) for t_lp, _, t_text in (tops[k] if k < len(tops) else [])
        ]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: list, tops: list) -> dict[str, Any]:
    """OpenAI (legacy) completions ``logprobs``: tokens, token_logprobs, top_logprobs."""
    tokens = [text or "" for _, _, text in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [
            {(t_text or ""): t_lp for t_lp, _, t_text in (tops[k] if k < len(tops) else [])}
            for k in range(len(entries))
        ],
        "text_offset": offsets,
    }


_GENERATE_FIELDS = {
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "priority",
    "extra_key",
    "lora_path",
}


def _error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _value_error(e: ValueError, names: dict[str, str] | None = None) -> APIError:
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


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _json_body(request: Request, limit: int) -> Any:
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


async def _guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream whose failure after the response started ends it with an error event in
    OpenAI's shape (the status line is already sent) instead of a cut connection."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:  # noqa: BLE001 - any failure of the route's own code
        logger.exception("stream failed")
        yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield b"data: [DONE]\n\n"


class _APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from handlers)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != self.expected:
                err = APIError(401, "missing or wrong API key (Authorization: Bearer <key>)")
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine) -> FastAPI:
    args = engine.server_args
    model_name = args.served_model_name or args.model

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Stop the scheduler process before uvicorn re-raises SIGTERM/SIGINT and exits.
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="Loom", version="0.1.0", lifespan=lifespan)
    metrics = None
    if not args.disable_metrics:
        from loom.server.metrics import Metrics

        metrics = Metrics(model_name)
        engine.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        # unknown routes (404), wrong methods (405): OpenAI's shape like every other error
        return _error_response(APIError(err.status_code, str(err.detail)))

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
        return _error_response(APIError(500, f"internal error: {type(err).__name__}: {err}"))

    if args.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=args.api_key)

    # ---- helpers --------------------------------------------------------------------------

    body_limit = int(args.max_request_body_mb * 2**20)

    async def body_of(request: Request) -> Any:
        return await _json_body(request, body_limit)

    def adapters() -> list[str]:
        return sorted(engine.lora_names or ())

    def check_model(req: ParsedRequest) -> None:
        """The model a request names: the served model, one of its LoRA adapters (``NAME`` or
        ``BASE:NAME``, vLLM's and SGLang's spellings), or a 404. An adapter becomes the
        request's ``lora``; ``lora_path`` may name it too, but not a different one."""
        name = req.model
        if name is None or name in (model_name, args.model):
            return
        base, sep, adapter = name.partition(":")
        if not sep or base not in (model_name, args.model):
            adapter = name
        if adapter not in adapters():
            known = ", ".join(repr(n) for n in [model_name, *adapters()])
            why = f"this server serves {known}"
            if sep and adapter != name and engine.lora_names is None:
                why = (
                    f"LoRA adapter {adapter!r} requested, but {why} and no adapters (--lora-paths)"
                )
            raise APIError(404, f"model {name!r} not found; {why}", "model", code="model_not_found")
        if req.lora is not None and req.lora != adapter:
            raise bad(f"model names adapter {adapter!r} but lora_path is {req.lora!r}", "model")
        req.lora = adapter

    def admit(count: int) -> None:
        if engine._loop_error is not None:
            raise APIError(503, f"the scheduler has failed: {engine._loop_error}")
        if (
            args.max_queued_requests is not None
            and engine.num_waiting + count > args.max_queued_requests
        ):
            raise APIError(
                503, f"too many queued requests (limit {args.max_queued_requests}); retry later"
            )

    async def start(
        input_ids: list[int] | None,
        text: str | None,
        sampling: dict[str, Any],
        req: ParsedRequest | None = None,
        logprobs: bool | None = None,
        logprob_start_len: int = -1,
    ) -> AsyncIterator[dict[str, Any]]:
        if logprobs is None:
            logprobs = req.logprobs if req else False
        try:
            return await engine.async_generate(
                prompt=text,
                input_ids=input_ids,
                sampling_params=sampling,
                stream=True,
                priority=req.priority if req else None,
                extra_key=req.extra_key if req else None,
                lora_path=req.lora if req else None,
                return_logprob=logprobs,
                top_logprobs_num=req.top_logprobs if req and req.logprobs else 0,
                logprob_start_len=logprob_start_len,
            )
        except ValueError as e:
            raise _value_error(e, req.names if req else None) from e

    async def merged(streams: list[AsyncIterator[dict[str, Any]]]):
        """Yield (index, increment) from several streams as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, s):
            try:
                async for inc in s:
                    await queue.put((i, inc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(streams)
            while live:
                i, inc = await queue.get()
                if inc is None:
                    live -= 1
                else:
                    yield i, inc
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()

    async def until_done(request: Request, task: asyncio.Task) -> Any:
        """``task``'s result; cancelled (which aborts its streams) if the client goes away."""
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # merged()'s cleanup closes the streams, which aborts them
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")
        return task.result()

    async def collect(request: Request, streams) -> list[dict[str, Any]]:
        """Gather whole results; abort everything if the client goes away first. A request
        that failed after submission makes the response its error (4xx / 5xx)."""
        results = [
            {"text": "", "output_ids": [], "meta_info": {}, "logprobs": [], "top": []}
            for _ in streams
        ]

        async def run():
            async for i, inc in merged(streams):
                err = output_error(inc["meta_info"])
                if err is not None:
                    raise err  # (merged()'s cleanup aborts the other streams)
                r = results[i]
                r["text"] += inc["text"]
                r["output_ids"] += inc["output_ids"]
                r["meta_info"] = inc["meta_info"]
                r["logprobs"] += inc["meta_info"].get("output_token_logprobs", [])
                r["top"] += inc["meta_info"].get("output_top_logprobs", [])

        await until_done(request, asyncio.create_task(run()))
        return results

    async def first_of(request: Request, streams):
        """The first increment of ``streams`` and the rest of them (``merged``), waited for
        before a streamed response starts: a request that fails before its first token gets
        its error as the response's status, in OpenAI's shape."""
        rest = merged(streams)

        async def pull():
            return await rest.__anext__()

        try:
            first = await until_done(request, asyncio.create_task(pull()))
        except BaseException:
            await rest.aclose()
            raise
        err = output_error(first[1]["meta_info"])
        if err is not None:
            await rest.aclose()
            raise err
        return first, rest

    async def chained(first, rest):
        yield first
        async for item in rest:
            yield item

    def stream_response(events: AsyncIterator[bytes], rest) -> StreamingResponse:
        async def body():
            try:
                async for chunk in _guarded(events):
                    yield chunk
            finally:  # a client gone mid-stream: its requests are aborted now, not when collected
                await rest.aclose()

        return StreamingResponse(body(), media_type="text/event-stream")

    def usage(metas: list[dict[str, Any]], n: int) -> dict[str, Any]:
        """OpenAI usage from each stream's last meta_info; streams are prompt-major with ``n``
        choices per prompt, and a prompt is counted once however many choices it has."""
        completion = sum(m.get("completion_tokens", 0) for m in metas)
        prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
        cached = sum(m.get("cached_tokens", 0) for m in metas[::n])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def choice_params(sampling: dict[str, Any], n: int, i: int) -> dict[str, Any]:
        """Choice ``i`` of ``n`` samples of one prompt: seeded choices must still differ."""
        params = dict(sampling)
        if n > 1:
            params["n"] = 1
            for key in ("seed", "sampling_seed"):  # SGLang accepts either name
                if isinstance(params.get(key), int) and not isinstance(params[key], bool):
                    params[key] += i
        return params

    # ---- OpenAI routes --------------------------------------------------------------------

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "loom",
                    "root": args.model,
                    "max_model_len": engine.context_len,
                },
                *(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "loom",
                        "root": name,
                        "parent": model_name,
                        "max_model_len": engine.context_len,
                    }
                    for name in adapters()
                ),
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, messages = parse_chat(await body_of(request))
        check_model(req)
        try:
            ids = engine.apply_chat_template(messages)
        except ValueError as e:
            raise _value_error(e) from e
        admit(req.n)
        streams = [
            await start(ids, None, choice_params(req.sampling, req.n, i), req) for i in range(req.n)
        ]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": model_name}
        if not req.stream:
            results = await collect(request, streams)
            return {
                **base,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": r["text"]},
                        "finish_reason": finish_reason(r["meta_info"].get("finish_reason")),
                        "logprobs": chat_logprobs(r["logprobs"], r["top"])
                        if req.logprobs
                        else None,
                    }
                    for i, r in enumerate(results)
                ],
                "usage": usage([r["meta_info"] for r in results], req.n),
            }

        first, rest = await first_of(request, streams)

        async def events():
            chunk = {**base, "object": "chat.completion.chunk"}
            for i in range(req.n):
                yield _sse(
                    {
                        **chunk,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            metas: list[dict[str, Any]] = [{} for _ in streams]
            async for i, inc in chained(first, rest):
                meta = metas[i] = inc["meta_info"]
                reason = finish_reason(meta.get("finish_reason"))
                if inc["text"] or (req.logprobs and meta.get("output_token_logprobs")):
                    choice = {"index": i, "delta": {"content": inc["text"]}, "finish_reason": None}
                    if req.logprobs:
                        choice["logprobs"] = chat_logprobs(
                            meta.get("output_token_logprobs", []),
                            meta.get("output_top_logprobs", []),
                        )
                    yield _sse({**chunk, "choices": [choice]})
                if reason is not None:
                    yield _sse(
                        {**chunk, "choices": [{"index": i, "delta": {}, "finish_reason": reason}]}
                    )
                if (err := output_error(meta)) is not None:
                    yield _sse(err.body())
            if req.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompts = parse_completion(await body_of(request))
        check_model(req)
        k = req.best_of  # samples per prompt (>= n); the n best by mean logprob are returned
        admit(k * len(prompts))
        echo_lp = req.echo and req.logprobs
        streams, prompt_texts = [], []
        for p in prompts:
            text, ids = (p, None) if isinstance(p, str) else (None, p)
            prompt_texts.append(text if text is not None else _decode(engine, ids))
            for i in range(k):
                streams.append(
                    await start(
                        ids,
                        text,
                        choice_params(req.sampling, k, i),
                        req,
                        logprobs=req.logprobs or k > req.n,
                        logprob_start_len=0 if echo_lp else -1,
                    )
                )
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": model_name}

        def choice_logprobs(r: dict[str, Any]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            entries, tops = r["logprobs"], r["top"]
            if echo_lp:
                prompt_lps = r["meta_info"].get("input_token_logprobs", [])
                entries = prompt_lps + entries
                tops = [[] for _ in prompt_lps] + tops
            return completion_logprobs(entries, tops)

        if not req.stream:
            results = await collect(request, streams)
            chosen = []
            for j in range(len(prompts)):
                group = results[j * k : (j + 1) * k]
                if k > req.n:
                    group = sorted(group, key=_mean_logprob, reverse=True)[: req.n]
                chosen += [(j, r) for r in group]
            return {
                **base,
                "object": "text_completion",
                "choices": [
                    {
                        "index": i,
                        "text": (prompt_texts[j] if req.echo else "") + r["text"],
                        "logprobs": choice_logprobs(r),
                        "finish_reason": finish_reason(r["meta_info"].get("finish_reason")),
                    }
                    for i, (j, r) in enumerate(chosen)
                ],
                "usage": usage([r["meta_info"] for r in results], k),
            }

        first, rest = await first_of(request, streams)

        async def events():
            chunk = {**base, "object": "text_completion"}
            metas: list[dict[str, Any]] = [{} for _ in streams]
            echoed: set[int] = set()
            async for i, inc in chained(first, rest):
                if req.echo and i not in echoed:
                    echoed.add(i)
                    head = {"text": prompt_texts[i // k], "logprobs": None, "finish_reason": None}
                    if echo_lp:
                        head["logprobs"] = completion_logprobs(
                            inc["meta_info"].get("input_token_logprobs", []), []
                        )
                    yield _sse({**chunk, "choices": [{"index": i, **head}]})
                meta = metas[i] = inc["meta_info"]
                reason = finish_reason(inc["meta_info"].get("finish_reason"))
                lp = None
                if req.logprobs:
                    lp = completion_logprobs(
                        meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", [])
                    )
                if inc["text"] or reason is not None or (lp and lp["tokens"]):
                    yield _sse(
                        {
                            **chunk,
                            "choices": [
                                {
                                    "index": i,
                                    "text": inc["text"],
                                    "logprobs": lp,
                                    "finish_reason": reason,
                                }
                            ],
                        }
                    )
                if (err := output_error(meta)) is not None:
                    yield _sse(err.body())
            if req.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    # ---- SGLang-native routes -------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for key in body:
            if key not in _GENERATE_FIELDS:
                raise bad(f"unknown field {show(key)}", key[:64])
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise bad("give exactly one of text or input_ids", "text")
        if text is not None:
            batch = isinstance(text, list)
            items = [(t, None) for t in (text if batch else [text])]
        else:
            if not isinstance(input_ids, list):
                raise bad("input_ids must be a list of token ids (or of such lists)", "input_ids")
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            items = [(None, ids) for ids in (input_ids if batch else [input_ids])]
        if not items:
            raise bad("the batch is empty", "text" if text is not None else "input_ids")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(items)
        per_item = {}
        for key in ("rid", "priority", "extra_key", "lora_path"):
            v = body.get(key)
            per_item[key] = v if isinstance(v, list) else [v] * len(items)
            if len(per_item[key]) != len(items):
                raise bad(f"{key} list must match the batch size", key)
        if not all(r is None or isinstance(r, str) for r in per_item["rid"]):
            raise bad("rid must be a string (or a list of strings for a batch)", "rid")
        if len(params_list) != len(items):
            raise bad("sampling_params list must match the batch size", "sampling_params")
        rids = list(
            zip(
                per_item["rid"],
                per_item["priority"],
                per_item["extra_key"],
                per_item["lora_path"],
                strict=True,
            )
        )
        lp_kw = {
            k: body[k]
            for k in ("return_logprob", "top_logprobs_num", "logprob_start_len")
            if k in body
        }
        expanded = []  # n > 1: n requests per prompt (seeded ones get seed + i)
        for item, sp, meta in zip(items, params_list, rids, strict=True):
            if not isinstance(sp, dict):
                raise bad("sampling_params must be an object", "sampling_params")
            n = sp.get("n", 1)
            if isinstance(n, int) and not isinstance(n, bool) and 1 < n <= 64:
                batch = True
                for i in range(n):
                    r = f"{meta[0]}-{i}" if meta[0] else None
                    expanded.append((item, choice_params(sp, n, i), (r, *meta[1:])))
            else:
                expanded.append((item, sp, meta))
        admit(len(expanded))
        streams = []
        for (t, ids), sp, (r, prio, key, lora) in expanded:
            try:
                streams.append(
                    await engine.async_generate(
                        prompt=t,
                        input_ids=ids,
                        sampling_params=sp,
                        rid=r,
                        stream=True,
                        priority=prio,
                        extra_key=key,
                        lora_path=lora,
                        **lp_kw,
                    )
                )
            except ValueError as e:
                for s in streams:
                    await s.aclose()
                raise _value_error(e) from e
        if not stream:
            results = await collect(request, streams)
            for r in results:  # whole-request logprob lists in meta_info, as SGLang returns
                lps, tops = r.pop("logprobs"), r.pop("top")
                if "output_token_logprobs" in r["meta_info"]:
                    r["meta_info"]["output_token_logprobs"] = lps
                if "output_top_logprobs" in r["meta_info"]:
                    r["meta_info"]["output_top_logprobs"] = tops
            return results if batch else results[0]

        first, rest = await first_of(request, streams)

        async def events():
            acc = [{"text": "", "output_ids": []} for _ in streams]
            async for i, inc in chained(first, rest):
                acc[i]["text"] += inc["text"]
                acc[i]["output_ids"] += inc["output_ids"]
                out = {
                    "text": acc[i]["text"],
                    "output_ids": list(acc[i]["output_ids"]),
                    "meta_info": inc["meta_info"],
                }
                if batch:
                    out["index"] = i
                yield _sse(out)
                if (err := output_error(inc["meta_info"])) is not None:
                    yield _sse(err.body())
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    @app.get("/health")
    async def health():
        if engine._loop_error is not None:
            raise APIError(503, f"the scheduler has failed: {engine._loop_error}")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        try:
            out = await asyncio.wait_for(
                engine.async_generate(
                    input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
                ),
                60,
            )
        except Exception as e:
            raise APIError(503, f"generation failed: {e}") from e
        if out["meta_info"]["completion_tokens"] != 1:
            raise APIError(503, "generation produced no token")
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "served_model_name": model_name,
            "tokenizer_path": args.tokenizer_path or engine.model_path,
            "is_generation": True,
            "architecture": engine.info["architecture"],
            "context_length": engine.context_len,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return engine.get_server_info()

    @app.post("/flush_cache")
    async def flush_cache():
        engine.flush_cache()
        return Response(
            "Cache flush requested (done when no request is running).\n", status_code=200
        )

    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for key in ("lora_name", "lora_path"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise bad(f"load_lora_adapter needs a non-empty string {key!r}", key)
        try:
            await asyncio.to_thread(engine.load_lora_adapter, body["lora_name"], body["lora_path"])
        except ValueError as e:
            raise _value_error(e) from e
        return {"success": True, "loaded_adapters": adapters()}

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise bad('unload_lora_adapter needs {"lora_name": "..."}', "lora_name")
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, body["lora_name"])
        except ValueError as e:
            raise _value_error(e) from e
        return {"success": True, "loaded_adapters": adapters()}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            raise bad('abort_request needs {"rid": "..."}', "rid")
        engine.abort_request(body["rid"])
        return Response(status_code=200)

    if metrics is not None:

        @app.get("/metrics")
        async def metrics_route():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
