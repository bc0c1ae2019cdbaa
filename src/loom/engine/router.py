"""Routing the scheduler's outputs to the requests waiting for them.

Every request in flight has a ``ReqState`` here, by id, with its output queue (a thread queue,
an asyncio queue fed through its loop, or a queue shared by the requests of one batch, which
gets each step's outputs as one list). Control messages (loading an adapter) wait for their
reply here too. ``on_batch`` runs where the backend receives (its thread, or the HTTP server's
event loop, whose requests' queues it then fills directly); everything else on callers'.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Callable

from loom.engine.outputs import ReqState
from loom.engine.profile import FrontendProfile
from loom.scheduler.messages import ReqOutput, SchedulerBatchOut
from loom.scheduler.stats import hist_add


class OutputRouter:
    def __init__(self, profile: FrontendProfile | None = None) -> None:
        self.profile = profile or FrontendProfile()
        self.states: dict[str, ReqState] = {}
        self.control: dict[str, queue.Queue] = {}  # replies to control messages, by id
        self.lock = threading.Lock()
        self.metrics = None  # set by the HTTP server: observe_outputs / observe_load
        # the LoRA registry's release: a forgotten request no longer holds its adapter
        self.lora_release: Callable[[str], None] | None = None

    def register(self, st: ReqState) -> None:
        with self.lock:
            if st.rid in self.states:
                raise ValueError(f"duplicate request id {st.rid!r}")
            self.states[st.rid] = st

    def forget(self, rid: str) -> None:
        with self.lock:
            st = self.states.pop(rid, None)
        if st is not None:
            self._release(st)

    def _release(self, st: ReqState) -> None:
        """A forgotten request no longer holds its adapter."""
        if st.lora_id is not None and self.lora_release is not None:
            self.lora_release(st.lora_id)

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
        hist_add(self.profile.handover_receive_hist, now - batch.sent_at)
        metrics = self.metrics
        with self.lock:
            found = [
                (out, self.states.get(out.rid), self.control.get(out.rid)) for out in batch.outputs
            ]
        if metrics is not None:  # (before the times below are stamped)
            metrics.observe_outputs([(st, out) for out, st, _ in found if st is not None], now)
        # One hand-over per waiting queue or event loop a step, not one per request: a batch's
        # shared queue gets the step's outputs as one list, and each event loop one callback
        # that fills its requests' queues (each call_soon_threadsafe wakes the loop and takes
        # the interpreter lock from this thread when it is the scheduler's or the receiver's).
        grouped: dict[int, tuple[queue.Queue, list[ReqOutput]]] = {}
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list]] = {}
        for out, st, control in found:
            if control is not None:  # the reply to a control message
                control.put(out)
                continue
            if st is None:
                continue
            # Stamp times here: the caller may read outputs late.
            if out.new_token_ids:
                if st.first_token_time is None:
                    st.first_token_time = now
                st.last_token_time = now
            if out.finished_reason is not None:
                st.finish_time = now
            if st.shared:
                grouped.setdefault(id(st.outputs), (st.outputs, []))[1].append(out)
            elif st.loop is not None:
                by_loop.setdefault(id(st.loop), (st.loop, []))[1].append((st.outputs, out))
            else:
                st.outputs.put(out)
        for q, outs in grouped.values():
            q.put(outs)
        deliver_hist = self.profile.handover_deliver_hist
        try:
            here = asyncio.get_running_loop()  # receiving on a loop (ProcessBackend.receive_on)
        except RuntimeError:
            here = None
        for loop, items in by_loop.values():
            if loop is here:
                _deliver((items, batch.sent_at, deliver_hist))
            else:
                _call_soon(loop, _deliver, (items, batch.sent_at, deliver_hist))
        if metrics is not None:
            metrics.observe_load(batch.stats)

    def end_all(self, message: str, status: int, abort: Callable[[str], None]) -> int:
        """End every request in flight with an error (``status``: the HTTP status its client
        gets) and ``abort`` it in the scheduler; returns how many there were.

        The requests are forgotten first, under the lock, so the scheduler's reply to the
        abort (a plain abort, no error) is dropped: the receiver may drain that reply on the
        requests' loop inside the callback that is running while this thread queues the
        error, which would deliver the reply first."""
        with self.lock:
            states = list(self.states.values())
            self.states.clear()
        now = time.monotonic()
        ended = []
        for st in states:
            out = ReqOutput(
                st.rid,
                [],
                st.prompt_tokens,
                len(st.output_ids),
                finished_reason={"type": "abort", "message": message, "status_code": status},
                error=message,
            )
            ended.append((st, out))
            st.finish_time = now
            if st.shared:  # a batch's queue takes lists
                st.outputs.put([out])
            else:
                put(st, out)
            self._release(st)
            abort(st.rid)
        if self.metrics is not None:
            self.metrics.observe_outputs(ended, now)
        return len(states)


def put(st: ReqState, out: ReqOutput) -> None:
    if st.loop is not None:
        _call_soon(st.loop, st.outputs.put_nowait, out)
    else:
        st.outputs.put(out)


def _deliver(arg: tuple[list[tuple[asyncio.Queue, ReqOutput]], float, list[int]]) -> None:
    """On the requests' event loop: fill their queues (and count the hand-over's delay)."""
    items, sent_at, hist = arg
    hist_add(hist, time.monotonic() - sent_at)
    for q, out in items:
        q.put_nowait(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: its callers are gone
        loop.call_soon_threadsafe(fn, arg)
