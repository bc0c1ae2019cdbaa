"""Several front ends on one scheduler (``loom serve --tokenizer-worker-num N``).

Each front end (a process with its own HTTP server, tokenizer and detokenizer; they share the
listening socket) binds a pair of ZMQ sockets: requests go in on one, and the scheduler sends
that front end's outputs back on the other. Front end 0 is the process that started the
scheduler (``ProcessBackend`` with ``front_ends=N``); the others attach through a
``FrontEndSlot`` (``AttachedBackend``).

In the scheduler's process ``OwnerRouting`` reads every front end's socket and remembers which
one sent each request (and each control message), until that request's last output: a step's
outputs then leave as one message per front end that has outputs in it. Every front end hears
from the scheduler at least once a ``heartbeat_s`` (its load figures), with or without outputs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from loom.engine.backends import OnBatch, OnFailure, ProcessBackend
from loom.scheduler.messages import AddRequests, Message, ReqOutput, SchedulerBatchOut


@dataclass(frozen=True)
class FrontEndSlot:
    """What a front end needs to attach to a running scheduler: its index (its requests'
    owner there), its two socket addresses, and the scheduler's start-up ``info``."""

    index: int
    in_addr: str
    out_addr: str
    info: dict[str, Any]


class OwnerRouting:
    """The scheduler's ``poll`` and ``emit`` over several front ends' sockets."""

    def __init__(self, pulls: list, pushes: list, heartbeat_s: float = 1.0) -> None:
        import zmq

        self._zmq = zmq
        self.pulls = pulls
        self.pushes = pushes
        self.owner: dict[str, int] = {}  # request or control-message id -> front end
        self.heartbeat_s = heartbeat_s
        self._last_sent = [0.0] * len(pushes)
        self._stats: dict[str, Any] = {}
        self._poller = zmq.Poller()
        for pull in pulls:
            self._poller.register(pull, zmq.POLLIN)

    def poll(self, timeout: float) -> list[Message]:
        msgs: list[Message] = []
        if timeout > 0 and not self._poller.poll(int(timeout * 1000)):
            return msgs
        for i, pull in enumerate(self.pulls):
            while True:
                try:
                    msg = pull.recv_pyobj(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                msg = self._claim(i, msg)
                if msg is not None:
                    msgs.append(msg)
        return msgs

    def _claim(self, i: int, msg: Message) -> Message | None:
        """Record front end ``i`` as the owner of what ``msg`` starts. A request id another
        front end has in flight is refused (to ``i``, which holds a state for it)."""
        if isinstance(msg, AddRequests):
            keep, refused = [], []
            for req in msg.requests:
                if req.rid in self.owner:
                    error = f"duplicate request id {req.rid!r}: a request with it is running"
                    reason = {"type": "abort", "message": error, "status_code": 400}
                    refused.append(ReqOutput(req.rid, [], len(req.input_ids), 0, 0, reason, error))
                else:
                    self.owner[req.rid] = i
                    keep.append(req)
            if refused:
                self._send(i, SchedulerBatchOut(refused, self._stats))
            return AddRequests(keep) if keep else None
        message_id = getattr(msg, "id", None)  # LoadLoRA, UnloadLoRA, UpdateWeights
        if message_id is not None:
            self.owner[message_id] = i
        return msg

    def emit(self, batch: SchedulerBatchOut) -> None:
        self._stats = batch.stats
        groups: dict[int, list[ReqOutput]] = {}
        owner = self.owner
        for out in batch.outputs:
            i = owner.get(out.rid)
            if i is None:  # (an abort of a request already ended)
                continue
            if out.finished_reason is not None:
                del owner[out.rid]
            groups.setdefault(i, []).append(out)
        now = time.monotonic()
        for i in range(len(self.pushes)):
            outs = groups.get(i)
            if outs is not None:
                self._send(i, SchedulerBatchOut(outs, batch.stats, batch.sent_at), now)
            elif not batch.outputs or now - self._last_sent[i] > self.heartbeat_s:
                self._send(i, SchedulerBatchOut([], batch.stats, batch.sent_at), now)

    def _send(self, i: int, batch: SchedulerBatchOut, now: float | None = None) -> None:
        self._last_sent[i] = time.monotonic() if now is None else now
        # (never blocks: the socket queues without bound on a pipe that exists from connect)
        with contextlib.suppress(self._zmq.Again):
            self.pushes[i].send_pyobj(batch, self._zmq.NOBLOCK)


class AttachedBackend(ProcessBackend):
    """A front end attached to a scheduler that another front end started: it binds its
    slot's sockets and receives as ``ProcessBackend`` does. The scheduler's death reaches it as
    a ``fatal`` message (from the scheduler, or from the front end that started it); stopping
    the scheduler is that front end's job."""

    def __init__(self, slot: FrontEndSlot, on_batch: OnBatch, on_failure: OnFailure) -> None:
        import zmq

        self._on_batch = on_batch
        self._on_failure = on_failure
        self.receive_s = 0.0
        self._loop = None
        self._failed = False
        self._dir = None
        self.slots = []
        self.process = None
        self.info = dict(slot.info)
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.bind(slot.in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(slot.out_addr)
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._receiver = threading.Thread(target=self._receive, name="loom-receiver", daemon=True)
        self._receiver.start()

    def _alive(self) -> bool:
        return not self._failed and _running(self.info["scheduler_pid"])

    def _died(self) -> None:
        if not self._failed:
            self._failed = True
            self._on_failure(RuntimeError("the scheduler process died"))

    def _watch(self) -> None:
        """(Nothing to watch: the scheduler is not this process's child.)"""

    def shutdown(self, timeout: float = 3.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._receiver is not threading.current_thread():
            self._receiver.join(timeout=2)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop_reading)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (where there is /proc, an exited child its parent has not
    yet waited for counts as exited)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
