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

from loom.server.protocol import (
    APIError,
    ParsedRequest,
    bad,
    finish_reason,
    parse_chat,
    parse_completion,
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


def _value_error(e: ValueError) -> APIError:
    """Engine validation errors start with the offending field's name."""
    import dataclasses

    from loom.sampling.sampling_params import SamplingParams

    msg = str(e)
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


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"malformed JSON body: {e}") from e


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

    if args.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=args.api_key)

    # ---- helpers --------------------------------------------------------------------------

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
            raise _value_error(e) from e

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

    async def collect(request: Request, streams) -> list[dict[str, Any]]:
        """Gather whole results; abort everything if the client goes away first."""
        results = [
            {"text": "", "output_ids": [], "meta_info": {}, "logprobs": [], "top": []}
            for _ in streams
        ]

        async def run():
            async for i, inc in merged(streams):
                r = results[i]
                r["text"] += inc["text"]
                r["output_ids"] += inc["output_ids"]
                r["meta_info"] = inc["meta_info"]
                r["logprobs"] += inc["meta_info"].get("output_token_logprobs", [])
                r["top"] += inc["meta_info"].get("output_top_logprobs", [])

        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # merged()'s cleanup closes the streams, which aborts them
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "client disconnected")
        task.result()
        return results

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
        req, messages = parse_chat(await _json_body(request))
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
            async for i, inc in merged(streams):
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
            if req.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, prompts = parse_completion(await _json_body(request))
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

        async def events():
            chunk = {**base, "object": "text_completion"}
            metas: list[dict[str, Any]] = [{} for _ in streams]
            echoed: set[int] = set()
            async for i, inc in merged(streams):
                if req.echo and i not in echoed:
                    echoed.add(i)
                    first = {"text": prompt_texts[i // k], "logprobs": None, "finish_reason": None}
                    if echo_lp:
                        first["logprobs"] = completion_logprobs(
                            inc["meta_info"].get("input_token_logprobs", []), []
                        )
                    yield _sse({**chunk, "choices": [{"index": i, **first}]})
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
            if req.include_usage:
                yield _sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- SGLang-native routes -------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for key in body:
            if key not in _GENERATE_FIELDS:
                raise bad(f"unknown field {key!r}", key)
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise bad("give exactly one of text or input_ids", "text")
        if text is not None:
            batch = isinstance(text, list)
            items = [(t, None) for t in (text if batch else [text])]
        else:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            items = [(None, ids) for ids in (input_ids if batch else [input_ids])]
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(items)
        per_item = {}
        for key in ("rid", "priority", "extra_key", "lora_path"):
            v = body.get(key)
            per_item[key] = v if isinstance(v, list) else [v] * len(items)
            if len(per_item[key]) != len(items):
                raise bad(f"{key} list must match the batch size", key)
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
        stream = bool(body.get("stream", False))
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

        async def events():
            acc = [{"text": "", "output_ids": []} for _ in streams]
            async for i, inc in merged(streams):
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
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

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
        body = await _json_body(request)
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
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise bad('unload_lora_adapter needs {"lora_name": "..."}', "lora_name")
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, body["lora_name"])
        except ValueError as e:
            raise _value_error(e) from e
        return {"success": True, "loaded_adapters": adapters()}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _json_body(request)
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
