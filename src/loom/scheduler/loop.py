"""The scheduler event loop, shared by the in-process engine (a thread) and ``loom serve`` (a
process of its own, fed over ZMQ).

Messages in (tuples): ``("add", [Req, ...])`` (a batch's requests arrive together, so one
``generate`` call's requests are scheduled together whatever the threads' timing),
``("load_lora", (id, name, path))`` and ``("unload_lora", (id, name, None))`` (answered by an
output for ``id`` whose ``error`` says why it failed), ``("abort", rid)``, ``("flush_cache", None)``,
``("shutdown", None)``. Batches out: ``SchedulerBatchOut`` (the step's outputs plus load figures),
emitted after every step that produced something and at least every ``stats_interval`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loom.scheduler.request import ReqOutput

if TYPE_CHECKING:
    from loom.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class SchedulerBatchOut:
    outputs: list[ReqOutput]
    stats: dict[str, Any] = field(default_factory=dict)


def scheduler_stats(sched: Scheduler) -> dict[str, Any]:
    alloc = sched.allocator
    used = (alloc.num_pages - alloc.num_free) * alloc.page_size
    hstats = getattr(sched.tree, "hstats", None)
    if hstats is not None:
        return {
            **_stats(sched, alloc, used),
            "hicache_host_tokens": sched.tree.host_size,
            "hicache_host_hit_tokens": hstats.host_hit_tokens,
            "hicache_storage_hit_tokens": hstats.storage_hit_tokens,
        }
    return _stats(sched, alloc, used)


def _stats(sched: Scheduler, alloc, used: int) -> dict[str, Any]:
    return {
        "num_running_reqs": len(sched.running) + (1 if sched.chunked_req else 0),
        "num_queued_reqs": len(sched.waiting),
        "kv_used_tokens": used,
        "kv_cached_tokens": sched.tree.total_size if sched.tree is not None else 0,
        "kv_cached_pages": (
            sched.tree.total_size // alloc.page_size if sched.tree is not None else 0
        ),
        "kv_total_tokens": alloc.num_pages * alloc.page_size,
        "kv_free_pages": alloc.num_free,
        "kv_total_pages": alloc.num_pages,
        # every SchedulerStats counter, by its field name (vars: no per-step deep copy)
        **vars(sched.stats),
    }


def run_scheduler_loop(
    sched: Scheduler,
    poll: Callable[[float], list[tuple[str, Any]]],
    emit: Callable[[SchedulerBatchOut], None],
    should_stop: Callable[[], bool],
    stats_interval: float = 1.0,
) -> None:
    """Run until ``should_stop()`` or a shutdown message. ``poll(timeout)`` returns pending
    messages, waiting up to ``timeout`` seconds only when the scheduler is idle."""
    try:
        _loop(sched, poll, emit, should_stop, stats_interval)
    finally:
        sched.close()


def _loop(sched, poll, emit, should_stop, stats_interval) -> None:
    last_emit = 0.0
    while not should_stop():
        stop = False
        for kind, payload in poll(0.0 if sched.has_work else 0.05):
            if kind == "add":
                outputs = [out for req in payload for out in sched.add_request(req)]
                if outputs:
                    emit(SchedulerBatchOut(outputs, scheduler_stats(sched)))
            elif kind in ("load_lora", "unload_lora"):
                rid, name, path = payload
                try:
                    if kind == "load_lora":
                        error = sched.load_lora(name, path)
                    else:
                        error = sched.unload_lora(name)
                except Exception as e:  # noqa: BLE001 - a bad control message ends only itself
                    logger.exception("%s %r failed", kind, name)
                    error = f"{kind} {name!r} failed: {type(e).__name__}: {e}"
                reason = {"type": "stop"} if error is None else {"type": "abort", "message": error}
                out = ReqOutput(rid, [], 0, 0, 0, reason, error)
                emit(SchedulerBatchOut([out], scheduler_stats(sched)))
            elif kind == "abort":
                sched.abort(payload)
            elif kind == "flush_cache":
                if not sched.flush_cache():
                    logger.warning("flush_cache ignored: requests are running")
            elif kind == "shutdown":
                stop = True
            else:
                logger.error("unknown scheduler message %r", kind)
        if stop:
            return
        outputs = sched.step() if sched.has_work else []
        now = time.monotonic()
        if outputs or now - last_emit > stats_interval:
            emit(SchedulerBatchOut(outputs, scheduler_stats(sched)))
            last_emit = now
