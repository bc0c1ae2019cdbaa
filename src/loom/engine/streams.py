"""A request's increments as an iterator (``generate(stream=True)``) or an async iterator
(``async_generate(stream=True)``); closing either before the end aborts the request.

Each step yields everything that arrived for the request since the last one, as one increment:
a caller that fell behind (a slow client, a busy event loop) catches up in one event instead
of one per token."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Any

from loom.engine.outputs import ReqState
from loom.scheduler.messages import ReqOutput

Consume = Callable[[ReqState, list[ReqOutput]], dict[str, Any]]
Forget = Callable[[ReqState], None]


def drain(q: queue.Queue | asyncio.Queue, first: ReqOutput) -> list[ReqOutput]:
    """``first`` and whatever else ``q`` holds now."""
    outs = [first]
    while not q.empty():
        outs.append(q.get_nowait())
    return outs


class SyncStream:
    """Iterator of a request's increments; closing it before the end aborts the request (also
    when iteration never started, which a generator's ``finally`` would miss)."""

    def __init__(self, st: ReqState, consume: Consume, forget: Forget) -> None:
        self._st, self._consume, self._forget = st, consume, forget

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._st.finished:
            raise StopIteration
        q = self._st.outputs
        return self._consume(self._st, drain(q, q.get()))

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

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._st.finished:
            raise StopAsyncIteration
        q = self._st.outputs
        return self._consume(self._st, drain(q, await q.get()))

    async def aclose(self) -> None:
        if not self._st.finished:
            self._st.finished = True
            self._forget(self._st)

    def __del__(self) -> None:
        st = getattr(self, "_st", None)
        if st is not None and not st.finished:
            st.finished = True
            self._forget(st)
