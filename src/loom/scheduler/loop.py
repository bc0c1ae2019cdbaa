"""The scheduler event loop, shared by the in-process engine (a thread) and ``loom serve`` (a
process of its own, fed over ZMQ): it applies the front end's messages (``messages.py``) and
steps the scheduler while there is work, emitting a ``SchedulerBatchOut`` after every step that
produced something and at least every ``stats_interval`` seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from loom.scheduler.messages import (
    Abort,
    AddRequests,
    FlushCache,
    LoadLoRA,
    Message,
    ReqOutput,
    SchedulerBatchOut,
    Shutdown,
    UnloadLoRA,
    UpdateWeights,
)
from loom.scheduler.request import Req
from loom.scheduler.stats import scheduler_stats

__all__ = ["SchedulerBatchOut", "run_scheduler_loop"]

if TYPE_CHECKING:
    from loom.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def run_scheduler_loop(
    sched: Scheduler,
    poll: Callable[[float], list[Message]],
    emit: Callable[[SchedulerBatchOut], None],
    should_stop: Callable[[], bool],
    stats_interval: float = 1.0,
) -> None:
    """Run until ``should_stop()`` or a shutdown message. ``poll(timeout)`` returns pending
    messages, waiting up to ``timeout`` seconds only when the scheduler is idle."""
    try:
        _loop(sched, poll, emit, should_stop, stats_interval)
    except RuntimeError as e:
        explained = sched.runner.explain_failure(e)
        if explained is e:
            raise
        raise explained from e
    finally:
        sched.close()


def _loop(sched, poll, emit, should_stop, stats_interval) -> None:
    last_emit = 0.0
    while not should_stop():
        sched.runner.check_ranks()
        stop = False
        if not sched.has_work:
            timeout = 0.05
        elif sched.waiting_on_loads:
            # sleeping here hands the GIL to the adapter reader: spinning, the loop kept it and
            # a 28 MiB adapter took 3.6 s to read on the 2-core CPU machine
            timeout = 0.002
        else:
            timeout = 0.0
        for msg in poll(timeout):
            if isinstance(msg, AddRequests):
                outputs = [
                    out for m in msg.requests for out in sched.add_request(Req.from_message(m))
                ]
                if outputs:
                    emit(SchedulerBatchOut(outputs, scheduler_stats(sched)))
            elif isinstance(msg, (LoadLoRA, UnloadLoRA)):
                reply = _lora(sched, msg)
                if reply is not None:
                    emit(SchedulerBatchOut([reply], scheduler_stats(sched)))
            elif isinstance(msg, UpdateWeights):
                emit(SchedulerBatchOut(_update_weights(sched, msg), scheduler_stats(sched)))
            elif isinstance(msg, Abort):
                sched.abort(msg.rid)
            elif isinstance(msg, FlushCache):
                if not sched.flush_cache():
                    logger.warning("flush_cache ignored: requests are running")
            elif isinstance(msg, Shutdown):
                stop = True
            else:
                logger.error("unknown scheduler message %r", msg)
        if stop:
            return
        loaded = [_reply(mid, error) for mid, error in sched.lora.poll()]
        if loaded:
            emit(SchedulerBatchOut(loaded, scheduler_stats(sched)))
        outputs = sched.step() if sched.has_work else []
        now = time.monotonic()
        if outputs or now - last_emit > stats_interval:
            emit(SchedulerBatchOut(outputs, scheduler_stats(sched)))
            last_emit = now
            sched.stats.time_emit_s += time.monotonic() - now


def _update_weights(sched, msg: UpdateWeights) -> list[ReqOutput]:
    """The outputs of the requests the update ended or drained, then the reply for its id."""
    try:
        error, outputs, paused = sched.update_weights_from_disk(
            msg.model_path, msg.load_format, msg.abort_all_requests
        )
    except Exception as e:  # noqa: BLE001 - a bad control message ends only itself
        logger.exception("update_weights_from_disk %r failed", msg.model_path)
        error, outputs, paused = f"{type(e).__name__}: {e}", [], 0
    reason = {"type": "stop" if error is None else "abort", "num_paused_requests": paused}
    if error is not None:
        reason["message"] = error
    return [*outputs, ReqOutput(msg.id, [], 0, 0, 0, reason, error)]


def _lora(sched, msg: LoadLoRA | UnloadLoRA) -> ReqOutput | None:
    """Unload an adapter, or begin loading one; the reply for the message's id (its error, if
    it failed), or None while a load is under way (``sched.lora.poll`` answers it)."""
    kind = "load_lora" if isinstance(msg, LoadLoRA) else "unload_lora"
    try:
        if isinstance(msg, LoadLoRA):
            error = sched.lora.start_load(msg.ref, msg.id)
            if error is None:
                return None
        else:
            error = sched.unload_lora(msg.lora_id, msg.name)
    except Exception as e:  # noqa: BLE001 - a bad control message ends only itself
        name = msg.ref.lora_name if isinstance(msg, LoadLoRA) else msg.name
        logger.exception("%s %r failed", kind, name)
        error = f"{kind} {name!r} failed: {type(e).__name__}: {e}"
    return _reply(msg.id, error)


def _reply(message_id: str, error: str | None) -> ReqOutput:
    reason = {"type": "stop"} if error is None else {"type": "abort", "message": error}
    return ReqOutput(message_id, [], 0, 0, 0, reason, error)
