"""One worker process of ``loom bench serving``: sends its share of the requests at their
arrival times over aiohttp, parses each stream as it arrives, and measures itself (its CPU time
and how late its event loop runs), so the report can tell whether the client was the limit.

Streams are parsed incrementally: SSE events are split from the received bytes as they come,
and each event's JSON is parsed once. The three endpoints:

- ``generate``: SGLang's ``/generate``; new tokens per event from ``meta_info.completion_tokens``
  (cumulative whether the server sends whole or incremental chunks).
- ``completions`` / ``chat``: OpenAI's streams (text deltas); the token count comes from the
  final usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency; json still parses
    _loads = json.loads


@dataclass
class WorkItem:
    index: int
    payload: list[int] | str  # token ids (generate, completions) or text (chat)
    output_len: int
    send_at: float  # seconds after the run's start


@dataclass
class WorkerSpec:
    base_url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    items: list[WorkItem]
    max_concurrency: int | None = None
    extra_sampling: dict[str, Any] = field(default_factory=dict)


def request_body(endpoint: str, model: str, item: WorkItem, extra: dict[str, Any]) -> dict:
    greedy = {"temperature": 0, "ignore_eos": True, **extra}
    if endpoint == "generate":
        return {
            "input_ids": item.payload,
            "stream": True,
            "sampling_params": {"max_new_tokens": item.output_len, **greedy},
        }
    body = {
        "model": model,
        "max_tokens": item.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        **greedy,
    }
    if endpoint == "completions":
        body["prompt"] = item.payload
    else:
        body["messages"] = [{"role": "user", "content": item.payload}]
    return body


class StreamParser:
    """Counts a stream's tokens and stamps the events that carried output."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.buf = bytearray()
        self.chunk_times: list[float] = []  # arrival of each event that carried output
        self.chunk_tokens: list[int] = []  # tokens in it (OpenAI streams: 0, unknown)
        self.tokens = 0
        self.prompt_tokens = 0
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                return
            event = bytes(self.buf[:end])
            del self.buf[: end + 2]
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    self._event(line[6:], now)

    def _event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        chunk = _loads(data)
        if "error" in chunk:  # the request failed after its stream started
            err = chunk["error"]
            self.error = f"error event: {err.get('message') if isinstance(err, dict) else err}"
            return
        if self.endpoint == "generate":
            meta = chunk["meta_info"]
            new = meta["completion_tokens"] - self.tokens
            self.prompt_tokens = meta.get("prompt_tokens", 0)
            if new > 0:
                self.tokens += new
                self.chunk_times.append(now)
                self.chunk_tokens.append(new)
            return
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]
            self.prompt_tokens = chunk["usage"]["prompt_tokens"]
        for choice in chunk.get("choices") or ():
            text = choice.get("text") if self.endpoint == "completions" else None
            if self.endpoint == "chat":
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("tool_calls")
            if text:
                self.chunk_times.append(now)
                self.chunk_tokens.append(0)


async def _one(session, spec: WorkerSpec, item: WorkItem) -> dict[str, Any]:
    import aiohttp

    body = request_body(spec.endpoint, spec.model, item, spec.extra_sampling)
    parser = StreamParser(spec.endpoint)
    start = time.monotonic()
    try:
        async with session.post(ENDPOINTS[spec.endpoint], json=body) as resp:
            if resp.status != 200:
                parser.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for data in resp.content.iter_any():
                    parser.feed(data, time.monotonic())
                if not parser.done and parser.error is None:
                    parser.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
        parser.error = f"{type(e).__name__}: {e}"
    return {
        "index": item.index,
        "start": start,
        "end": time.monotonic(),
        "chunk_times": parser.chunk_times,
        "chunk_tokens": parser.chunk_tokens,
        "output_tokens": parser.tokens,
        "prompt_tokens": parser.prompt_tokens,
        "error": parser.error,
    }


async def _probe_lag(samples: list[float], stop: asyncio.Event, period: float = 0.005) -> None:
    """How late the event loop wakes a sleeper: a busy client stamps tokens late."""
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(period)
        samples.append(time.monotonic() - t - period)


async def _run(spec: WorkerSpec, start_at: float) -> dict[str, Any]:
    import aiohttp

    # no cap on connections (aiohttp's default is 100, which would cap concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60)
    sem = asyncio.Semaphore(spec.max_concurrency or max(1, len(spec.items)))
    lag: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(
        base_url=spec.base_url, headers=spec.headers, connector=connector, timeout=timeout
    ) as session:

        async def send(item: WorkItem) -> dict[str, Any]:
            delay = start_at + item.send_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                return await _one(session, spec, item)

        delay = start_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        probe = asyncio.create_task(_probe_lag(lag, stop))
        cpu0, wall0 = time.process_time(), time.monotonic()
        results = await asyncio.gather(*(send(it) for it in spec.items))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        stop.set()
        await probe
    return {"results": results, "cpu_s": cpu, "wall_s": wall, "loop_lag_s": lag}


def worker_main(spec: WorkerSpec, conn) -> None:
    """A worker process: imports, says so, receives the start time (``time.monotonic()`` at
    which offset 0 falls; CLOCK_MONOTONIC is the same clock in every process), runs, and sends
    its figures back."""
    import aiohttp  # noqa: F401

    try:
        import uvloop
    except ImportError:
        uvloop = None
    conn.send("ready")
    start_at = conn.recv()
    runner = uvloop.run if uvloop is not None else asyncio.run
    conn.send(runner(_run(spec, start_at)))
