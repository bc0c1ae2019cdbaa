"""Decode: the running requests, one token each per step; overlap chaining; retraction.

With overlap (CUDA), a decode step can be launched on the device-side tokens of the step still
in flight (``chained``), so the host prepares step N+1 while the device runs step N. When the
pool cannot hold one more token per running request, the request that has done the least work
is retracted: its pages are freed (its computed KV cached) and it goes back to the front of the
queue with its output so far.

``new_token_ratio`` (SGLang's): the share of a request's remaining ``max_new_tokens`` admission
reserves pages for. It decays with every resolved decode step and rises with each retraction.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from loom.sampling.batch_sampler import BatchSampler, Sampled
from loom.scheduler.cache import CacheManager
from loom.scheduler.messages import ReqOutput
from loom.scheduler.request import Req
from loom.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class InflightStep:
    """A launched decode (or prefill) step whose sampled tokens may still be on their way to
    the host."""

    reqs: list[Req]
    tokens: torch.Tensor  # [bs] on the device
    host: Sampled  # host copies, filled by non-blocking copies
    event: torch.cuda.Event | None
    # CUDA: an event recorded before the step's forward (the device's start of the step) and
    # whether the step was launched while the one before it was still in flight
    begin: torch.cuda.Event | None = None
    chained: bool = False

    @classmethod
    def start(
        cls, reqs: list[Req], out: Sampled, begin=None, chained: bool = False
    ) -> InflightStep:
        host = Sampled(
            *(
                None if t is None else _to_host(t)
                for t in (
                    out.tokens,
                    out.logprobs,
                    out.top_values,
                    out.top_ids,
                    out.token_ids_values,
                )
            )
        )
        event = None
        if out.tokens.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=begin is not None)
            event.record()
        return cls(reqs, out.tokens, host, event, begin, chained)

    def host_results(self, stats: SchedulerStats) -> tuple[list[int], list]:
        """The tokens and, per row, None or (logprob, [(logprob, id), ...] top entries,
        [(logprob, id), ...] of the row's ``token_ids_logprob``)."""
        if self.event is not None:
            t = time.perf_counter()
            self.event.synchronize()
            stats.time_device_wait_s += time.perf_counter() - t
        s, bs = self.host, len(self.reqs)
        if s.logprobs is None:
            return s.tokens.tolist(), [None] * bs
        tops = (
            [
                list(zip(v, i, strict=True))
                for v, i in zip(s.top_values.tolist(), s.top_ids.tolist(), strict=True)
            ]
            if s.top_values is not None
            else [[] for _ in range(bs)]
        )
        chosen = [[] for _ in range(bs)]
        if s.token_ids_values is not None:
            values = s.token_ids_values.tolist()
            for row, req in enumerate(self.reqs):
                ids = req.token_ids_logprob or ()
                chosen[row] = list(zip(values[row][: len(ids)], ids, strict=True))
        return s.tokens.tolist(), list(zip(s.logprobs.tolist(), tops, chosen, strict=True))


Rows = Iterable[tuple[Req, int, object]]


class DecodeManager:
    """``apply(rows)`` applies a step's (request, token, logprob) rows and returns the outputs;
    ``schedule_conservativeness`` scales ``new_token_ratio``."""

    def __init__(
        self,
        runner,
        cache: CacheManager,
        sampler: BatchSampler,
        stats: SchedulerStats,
        apply: Callable[[Rows], list[ReqOutput]],
        schedule_conservativeness: float,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.sampler = sampler
        self.stats = stats
        self.apply = apply
        self.context_len = runner.model_config.context_len
        self.running: list[Req] = []
        self.inflight: InflightStep | None = None
        self.init_new_token_ratio = min(1.0, 0.7 * schedule_conservativeness)
        self.min_new_token_ratio = min(self.init_new_token_ratio, 0.14 * schedule_conservativeness)
        self.new_token_ratio = self.init_new_token_ratio
        # CUDA: decode steps are timed on the device (SchedulerStats.time_device_*)
        self._time_device = runner.device.type == "cuda"
        self._begin: torch.cuda.Event | None = None
        self._last_end: torch.cuda.Event | None = None

    def reset(self) -> None:
        """Forget the running batch and the step in flight (a failed step)."""
        self.running, self.inflight, self._begin = [], None, None

    def reset_ratio(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio

    def remove(self, req: Req) -> None:
        self.running = [r for r in self.running if r is not req]

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.is_finished]

    def pages_needed(self) -> int:
        """New pages the running requests' next tokens take (those at a page boundary)."""
        return sum(1 for r in self.running if r.kv_len % self.cache.page_size == 0)

    def reserved_pages(self, extra: Req | None = None) -> int:
        """Pages to keep free for the running requests (and ``extra``, a request still being
        prefilled): their unfilled prompts and expected output."""
        total = 0
        for req in self.running + ([extra] if extra is not None else []):
            remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
            future = req.seq_len - req.kv_len + math.ceil(remaining * self.new_token_ratio)
            total += self.cache.pages_for(req.kv_len + future) - len(req.kv_pages)
        return total

    def chainable(self) -> bool:
        """Whether the running batch can decode on the in-flight step's device-side tokens: it
        is that step's batch (those that finished since drop out: their rows of the in-flight
        tokens are skipped on the device), and the chained step stays inside the context. A
        request that finishes on the in-flight token (by length, a stop or its grammar) runs one
        step past it, as with stops: that token is discarded when it resolves, and its KV slot,
        released with the request, is reused only by steps queued after the one writing it."""
        if not self.running:
            return False
        # (running only shrinks between steps, keeping its order: new requests come by prefill)
        members = {id(r) for r in self.inflight.reqs}
        if any(id(r) not in members for r in self.running):
            return False
        if any(req.seq_len + 2 >= self.context_len for req in self.running):
            return False
        # Finished requests' pages sit in the prefix cache: evict unused ones for the room
        # rather than break the chain (the pages may still be read by the step in flight, but
        # whatever reuses them is queued after it on the same stream). Only a retraction needs
        # the unchained path.
        return self.cache.free_by_evicting(self.pages_needed())

    def host_before_sampling(self) -> bool:
        """Whether sampling needs the previous step's tokens on the host (grammars, logits
        processors)."""
        return any(
            r.grammar is not None or r.sampling_params.custom_logit_processor for r in self.running
        )

    def launch(self, chained: bool) -> InflightStep:
        """Launch one decode step over ``running`` (room ensured). ``chained``: the previous
        step is still in flight and its sampled tokens, still on the device, are the inputs."""
        logits, reqs = self.forward(chained)
        return self.start_sampling(logits, reqs, pending=1 if chained else 0)

    def forward(self, chained: bool) -> tuple[torch.Tensor, list[Req]]:
        t = time.perf_counter()
        self.stats.num_decode_batches += 1
        self.stats.num_decode_tokens += len(self.running)
        reqs = list(self.running)
        if self._time_device:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        locs = self.cache.alloc_next_slots(reqs)
        assert locs is not None, "decode room was ensured"
        positions = [req.kv_len for req in reqs]
        rows = [req.req_pool_idx for req in reqs]
        slots = [req.lora_slot for req in reqs]
        if chained:
            inflight = self.inflight
            id_rows = None
            # some finished since (their rows drop out), or the rows come in another order
            if len(reqs) != len(inflight.reqs) or not all(map(operator.is_, reqs, inflight.reqs)):
                at = {id(r): i for i, r in enumerate(inflight.reqs)}
                id_rows = [at[id(r)] for r in reqs]
            logits = self.runner.forward_decode(
                None, positions, locs, rows, slots, input_ids_dev=inflight.tokens, id_rows=id_rows
            )
        else:
            input_ids = [req.output_ids[-1] for req in reqs]
            logits = self.runner.forward_decode(input_ids, positions, locs, rows, slots)
        for req in reqs:
            req.kv_len += 1
        self.stats.time_forward_launch_s += time.perf_counter() - t
        return logits, reqs

    def start_sampling(self, logits: torch.Tensor, reqs: list[Req], pending: int) -> InflightStep:
        t = time.perf_counter()
        begin, self._begin = self._begin, None
        inflight = InflightStep.start(
            reqs,
            self.sampler.sample(logits, reqs, pending),
            begin,
            chained=self.inflight is not None,
        )
        self.stats.time_sampling_launch_s += time.perf_counter() - t
        return inflight

    def resolve(self, inflight: InflightStep) -> list[ReqOutput]:
        """Wait for a launched decode step's tokens and apply them."""
        t, waited = time.perf_counter(), self.stats.time_device_wait_s
        tokens, lps = inflight.host_results(self.stats)
        if inflight.begin is not None:
            self._time_on_device(inflight)
        else:  # a mixed step in flight (timed as prefill): no idle gap measured across it
            self._last_end = None
        outputs = self.apply(zip(inflight.reqs, tokens, lps, strict=True))
        self.drop_finished()
        self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - 0.001)
        dt = time.perf_counter() - t - (self.stats.time_device_wait_s - waited)
        self.stats.time_resolve_s += dt
        return outputs

    def _time_on_device(self, inflight: InflightStep) -> None:
        """The device's busy time for a resolved decode step and, if it was chained, the idle
        time before it (both events completed: the step's last one was waited for)."""
        self.stats.time_device_decode_s += inflight.begin.elapsed_time(inflight.event) / 1e3
        prev = self._last_end
        if inflight.chained and prev is not None:
            gap = max(prev.elapsed_time(inflight.begin) / 1e3, 0.0)
            st = self.stats
            st.time_device_idle_chained_s += gap
            st.num_device_idle_chained_steps += gap > 5e-4
            st.time_device_idle_chained_max_s = max(st.time_device_idle_chained_max_s, gap)
        self._last_end = inflight.event

    def ensure_room(self, retract: Callable[[Req], None], too_small: Callable[[Req], None]) -> None:
        """Make room for every running request's next token: first evict cached prefixes
        nobody is using, then ``retract`` the request that has done the least work (fewest
        outputs, longest prompt) until it fits. A request alone that does not fit is handed to
        ``too_small``."""
        while self.running and not self.cache.free_by_evicting(self.pages_needed()):
            if len(self.running) == 1:
                req = self.running.pop()
                logger.error("KV pool too small for request %s", req.rid)
                too_small(req)
                break
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            retract(victim)
            victim.num_retractions += 1
            self.stats.num_retractions += 1
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
            logger.info("retracted %s to free KV pages", victim.rid)
