"""A request's increments as an iterator (``generate(stream=True)``) or an async iterator
(``async_generate(stream=True)``); closing either before the end aborts the request.

Each step yields everything that arrived for the request since the last one, as one increment:
a caller that fell behind (a slow client, a busy event loop) catches up in one event instead
of one per token. A request's ``stream_interval`` (SGLang's) spaces them out: the first token at
once, then an increment whenever at least that many tokens are unsent, and the last one."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Any

from loom.engine.outputs import ReqState, merge_increments
from loom.scheduler.messages import ReqOutput

Consume = Callable[[ReqState, list[ReqOutput]], dict[str, Any]]
Forget = Callable[[ReqState], None]


def drain(q: queue.Queue | asyncio.Queue, first: ReqOutput) -> list[ReqOutput]:
    """``first`` and whatever else ``q`` holds now."""
    outs = [first]
    while not q.empty():
        outs.append(q.get_nowait())
    return outs


class _Interval:
    """Holds increments back until ``stream_interval`` tokens are unsent (SGLang's rule)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.pending: dict[str, Any] | None = None
        self.sent = 0  # tokens handed out

    def add(self, inc: dict[str, Any], finished: bool) -> dict[str, Any] | None:
        """The increment to hand out now (what is pending, ``inc`` merged in), or None."""
        self.pending = inc if self.pending is None else merge_increments(self.pending, inc)
        unsent = len(self.pending["output_ids"])
        if finished or unsent >= self.interval or (self.sent == 0 and unsent > 0):
            out, self.pending = self.pending, None
            self.sent += unsent
            return out
        return None


def _interval(st: ReqState) -> _Interval | None:
    k = st.params.stream_interval
    return _Interval(k) if k is not None and k > 1 else None


class SyncStream:
    """Iterator of a request's increments; closing it before the end aborts the request (also
    when iteration never started, which a generator's ``finally`` would miss)."""

    def __init__(self, st: ReqState, consume: Consume, forget: Forget) -> None:
        self._st, self._consume, self._forget = st, consume, forget
        self._interval = _interval(st)

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._st.finished:
                raise StopIteration
            q = self._st.outputs
            inc = self._consume(self._st, drain(q, q.get()))
            if self._interval is None:
                return inc
            inc = self._interval.add(inc, self._st.finished)
            if inc is not None:
                return inc

    def close(self) -> None:
        if not self._st.finished:
            self._st.finished = True
            self._forget(self._st)

    def __del__(self) -> None:
        self.close()


class AsyncStream:
    """Async iterator of a request's increments; ``aclose()`` before the end aborts it."""

    def __init__(self, st: ReqState, consume: Consume, forget: Forget) -> None:
        self._st, self._consume, self._forget = st, consume, forget
        self._interval = _interval(st)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            if self._st.finished:
                raise StopAsyncIteration
            q = self._st.outputs
            inc = self._consume(self._st, drain(q, await q.get()))
            if self._interval is None:
                return inc
            inc = self._interval.add(inc, self._st.finished)
            if inc is not None:
                return inc

    async def aclose(self) -> None:
        if not self._st.finished:
            self._st.finished = True
            self._forget(self._st)

    def __del__(self) -> None:
        st = getattr(self, "_st", None)
        if st is not None and not st.finished:
            st.finished = True
            self._forget(st)
