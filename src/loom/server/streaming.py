"""Streaming helpers shared by the routes: several engine streams merged into one, whole results
collected, the first increment awaited before a streamed response starts, and SSE framing with
an error event for a failure after the status line is sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import StreamingResponse

from loom.server.errors import APIError
from loom.server.protocol import output_error

if TYPE_CHECKING:
    from loom.engine.profile import FrontendProfile

logger = logging.getLogger(__name__)


def _dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # what orjson does not take (an int past 64 bits): the standard library
        return json.dumps(data, ensure_ascii=False).encode()


class EventEncoder:
    """Frames one server-sent event (``data: <json>``), counted and timed in ``profile``."""

    def __init__(self, profile: FrontendProfile | None = None) -> None:
        self.profile = profile

    def __call__(self, data: Any) -> bytes:
        t = time.perf_counter()
        event = b"data: " + _dumps(data) + b"\n\n"
        if self.profile is not None:
            self.profile.sse_events += 1
            self.profile.sse_s += time.perf_counter() - t
        return event


sse = EventEncoder()


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream whose failure after the response started ends it with an error event in
    OpenAI's shape (the status line is already sent) instead of a cut connection."""
    try:
        async for chunk in events:
            yield chunk
    except Exception as e:  # noqa: BLE001 - any failure of the route's own code
        logger.exception("stream failed")
        yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        yield b"data: [DONE]\n\n"


async def merged(streams: list[AsyncIterator[dict[str, Any]]]):
    """Yield (index, increment) from several streams as they arrive."""
    if len(streams) == 1:  # (no task and queue in between)
        try:
            async for inc in streams[0]:
                yield 0, inc
        finally:
            with contextlib.suppress(Exception):
                await streams[0].aclose()
        return
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


# the per-output-token lists of a result's meta_info (each increment carries only its new ones)
PER_TOKEN = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


async def collect(request: Request, streams) -> list[dict[str, Any]]:
    """Gather whole results; abort everything if the client goes away first. A request
    that failed after submission makes the response its error (4xx / 5xx). Each result's
    ``meta_info`` holds the whole output's logprob lists (``PER_TOKEN``), as SGLang returns
    them; ``logprobs`` and ``top`` are the first two of them (empty where not asked for)."""
    results = [
        {"text": "", "output_ids": [], "meta_info": {}, "lists": {k: [] for k in PER_TOKEN}}
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
            meta = r["meta_info"] = dict(inc["meta_info"])
            if "prompt_token_ids" in inc:  # (return_prompt_token_ids)
                r["prompt_token_ids"] = inc["prompt_token_ids"]
            for key, acc in r["lists"].items():
                if key in meta:
                    acc += meta[key]
                    meta[key] = acc

    await until_done(request, asyncio.create_task(run()))
    for r in results:
        lists = r.pop("lists")
        r["logprobs"], r["top"] = lists["output_token_logprobs"], lists["output_top_logprobs"]
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
            async for chunk in guarded(events):
                yield chunk
        finally:  # a client gone mid-stream: its requests are aborted now, not when collected
            await rest.aclose()

    return StreamingResponse(body(), media_type="text/event-stream")
