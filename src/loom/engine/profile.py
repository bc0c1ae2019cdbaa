"""Where the front end's time goes, counted as it runs: each stage's count and seconds, and each
process's CPU time. ``/server_info`` reports a snapshot under ``profile``; ``loom bench serving``
reads one before and after a run and prints the difference (CPU use per process, microseconds
per item of each stage).

Stages (each timed with two ``perf_counter`` calls, ~0.1 us, against stages of microseconds):
- ``output_message``: one scheduler message routed to its requests (``receive_s``: taking the
  messages off the socket and unpickling them, for a scheduler process);
- ``apply``: one output applied to its request (detokenising and stop strings included);
- ``detokenize``: detokenising, per token;
- ``sse``: one server-sent event encoded.

Hand-over delays (histograms, ``scheduler.stats.hist_add``), from the scheduler's emitting a
step's outputs (``SchedulerBatchOut.sent_at``): ``handover_receive_hist`` until this process
routes them, ``handover_deliver_hist`` until the event loop of the requests that wait for them
puts them in their queues. Their tail is latency the front end adds to every token.
"""

from __future__ import annotations

import os
import time
from typing import Any

from loom.scheduler.stats import new_hist


class FrontendProfile:
    def __init__(self) -> None:
        self.output_messages = 0
        self.output_message_s = 0.0
        self.outputs = 0
        self.apply_s = 0.0
        self.detokenized_tokens = 0
        self.detokenize_s = 0.0
        self.sse_events = 0
        self.sse_s = 0.0
        self.handover_receive_hist = new_hist()
        self.handover_deliver_hist = new_hist()

    def snapshot(self, scheduler_cpu_s: float | None) -> dict[str, Any]:
        """The counters now, with this process's CPU seconds (``front_cpu_s``) and the
        scheduler process's (``scheduler_cpu_s``; None when it runs in this process)."""
        snap: dict[str, Any] = {
            "wall_s": time.monotonic(),
            "front_cpu_s": time.process_time(),
            "front_pid": os.getpid(),
            **{k: list(v) if type(v) is list else v for k, v in vars(self).items()},
        }
        if scheduler_cpu_s is not None:
            snap["scheduler_cpu_s"] = scheduler_cpu_s
        return snap
