"""Routing the scheduler's outputs to the requests waiting for them.

Every request in flight has a ``ReqState`` here, by id, with its output queue (a thread queue,
an asyncio queue fed through its loop, or a queue shared by the requests of one batch, which
gets each step's outputs as one list). Control messages (loading an adapter) wait for their
reply here too. ``on_batch`` runs on the backend's thread; everything else on callers'.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable

from loom.engine.outputs import ReqState
from loom.scheduler.messages import ReqOutput, SchedulerBatchOut


class OutputRouter:
    def __init__(self) -> None:
        self.states: dict[str, ReqState] = {}
        self.control: dict[str, queue.Queue] = {}  # replies to control messages, by id
        self.lock = threading.Lock()
        self.metrics = None  # set by the HTTP server: observe_output / observe_load

    def register(self, st: ReqState) -> None:
        with self.lock:
            if st.rid in self.states:
                raise ValueError(f"duplicate request id {st.rid!r}")
            self.states[st.rid] = st

    def forget(self, rid: str) -> None:
        with self.lock:
            self.states.pop(rid, None)

    def all(self) -> list[ReqState]:
        with self.lock:
            return list(self.states.values())

    def expect_reply(self, rid: str) -> queue.Queue:
        reply: queue.Queue = queue.Queue()
        with self.lock:
            self.control[rid] = reply
        return reply

    def drop_reply(self, rid: str) -> None:
        with self.lock:
            self.control.pop(rid, None)

    def call(self, send, check_alive: Callable[[], None], message) -> ReqOutput:
        """Send the control message ``message(id)`` and wait for the scheduler's reply (an
        output whose ``error`` is set on failure), checking ``check_alive`` every second."""
        rid = f"loom-control-{uuid.uuid4().hex}"
        reply = self.expect_reply(rid)
        try:
            send(message(rid))
            while True:
                try:
                    return reply.get(timeout=1.0)
                except queue.Empty:
                    check_alive()
        finally:
            self.drop_reply(rid)

    def on_batch(self, batch: SchedulerBatchOut) -> None:
        now = time.monotonic()
        metrics = self.metrics
        # a batch's shared queue gets the step's outputs as one list: one put and one wake-up
        # of the waiting caller a step, not one per request (each a turn of the interpreter
        # lock taken from this thread when it is the scheduler's)
        grouped: dict[int, tuple[queue.Queue, list[ReqOutput]]] = {}
        for out in batch.outputs:
            with self.lock:
                st = self.states.get(out.rid)
                control = self.control.get(out.rid)
            if control is not None:  # the reply to a control message
                control.put(out)
                continue
            if st is not None:
                if metrics is not None:
                    metrics.observe_output(st, out, now)
                # Stamp times here: the caller may read outputs late.
                if out.new_token_ids:
                    if st.first_token_time is None:
                        st.first_token_time = now
                    st.last_token_time = now
                if out.finished_reason is not None:
                    st.finish_time = now
                if st.shared:
                    grouped.setdefault(id(st.outputs), (st.outputs, []))[1].append(out)
                else:
                    put(st, out)
        for q, outs in grouped.values():
            q.put(outs)
        if metrics is not None:
            metrics.observe_load(batch.stats)

    def end_all(self, message: str, status: int, abort: Callable[[str], None]) -> int:
        """End every request in flight with an error (``status``: the HTTP status its client
        gets) and ``abort`` it in the scheduler; returns how many there were."""
        states = self.all()
        for st in states:
            out = ReqOutput(
                st.rid,
                [],
                st.prompt_tokens,
                len(st.output_ids),
                finished_reason={"type": "abort", "message": message, "status_code": status},
                error=message,
            )
            if st.shared:  # a batch's queue takes lists
                st.outputs.put([out])
            else:
                put(st, out)
            abort(st.rid)
        return len(states)


def put(st: ReqState, out: ReqOutput) -> None:
    if st.loop is not None:
        st.loop.call_soon_threadsafe(st.outputs.put_nowait, out)
    else:
        st.outputs.put(out)
