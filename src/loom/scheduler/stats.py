"""The scheduler's counters (``SchedulerStats``), the load figures it reports with every
batch of outputs (``scheduler_stats``), and the latency histograms both it and the front end
keep (``hist_add`` / ``hist_quantile``: counts over fixed log-spaced buckets, so two snapshots
subtract into the distribution of what happened between them)."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

# Upper edges of the histogram buckets in seconds: 0.1 ms to ~6.6 s, four per octave (each
# bucket 19% wider than the one before); a last bucket counts what lies beyond.
HIST_EDGES_S = tuple(1e-4 * 2 ** (i / 4) for i in range(65))


def new_hist() -> list[int]:
    return [0] * (len(HIST_EDGES_S) + 1)


def hist_add(counts: list[int], seconds: float) -> None:
    counts[bisect.bisect_left(HIST_EDGES_S, seconds)] += 1


def hist_delta(after: list[int], before: list[int] | None) -> list[int]:
    return list(after) if not before else [a - b for a, b in zip(after, before, strict=True)]


def hist_quantile(counts: list[int], q: float) -> float:
    """The upper edge (seconds) of the bucket holding quantile ``q`` (0..1); nan when empty,
    inf in the overflow bucket."""
    total = sum(counts)
    if total == 0:
        return float("nan")
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank and c:
            return HIST_EDGES_S[i] if i < len(HIST_EDGES_S) else float("inf")
    return float("inf")


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_overlapped_batches: int = 0  # decode steps launched before the previous one resolved
    # prefill steps launched before the previous prefill's first tokens were applied
    num_overlapped_prefill_batches: int = 0
    num_mixed_batches: int = 0  # prefill batches that also decoded the running requests
    # mixed batches launched on the samples of the decode step still in flight (overlap)
    num_chained_mixed_batches: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_decode_tokens: int = 0  # the decode batches' sizes, summed
    # Host wall time inside step(), by the kind of batch the step ran, and the part of it spent
    # blocked on the device's results (near the step time: device-bound; near 0: host-bound).
    time_prefill_s: float = 0.0
    time_decode_s: float = 0.0
    time_device_wait_s: float = 0.0
    time_grammar_wait_s: float = 0.0  # idle steps waiting only for grammar compiles
    # Host time of decode steps by phase, device waits excluded (where a host-bound step goes):
    # building the inputs and launching the forward (or replaying its graph); the sampling
    # plan, logits processors, grammar masks and sampling kernels, and the copy of the tokens
    # to the host; applying the tokens (grammar matchers, stop checks, outputs). Grammar
    # bitmask fills are also counted alone (prefill steps' included).
    time_forward_launch_s: float = 0.0
    time_sampling_launch_s: float = 0.0
    time_resolve_s: float = 0.0
    time_grammar_mask_s: float = 0.0
    # CUDA, from events on the stream: the device's time from the start of a decode step's
    # forward to the end of its sampling, and for chained steps the time it sat idle between
    # the step before and this one (0 when the host launched ahead of the device, as overlap
    # intends; more when host work between steps, or a hidden sync, outlasts a step)
    time_device_decode_s: float = 0.0
    time_device_idle_chained_s: float = 0.0
    num_device_idle_chained_steps: int = 0  # chained steps the device waited over 0.5 ms for
    time_device_idle_chained_max_s: float = 0.0
    # CUDA: the device's time in prefill steps (mixed ones included), from events around each
    # prefill forward and its sampling; with time_device_decode_s, how busy the device was
    time_device_prefill_s: float = 0.0
    # handing each step's outputs to the front end (pickling and sending them, for a process)
    time_emit_s: float = 0.0
    # Triton kernels compiled after start-up, and their time: each stalled its step
    # (``model_executor.compile_watch``)
    num_triton_compiles: int = 0
    time_triton_compile_s: float = 0.0
    # Host wall time of each step() by what it ran (hist_add buckets): a decode step, a prefill
    # step, and a prefill step into which the running requests' decode was mixed. A request's
    # inter-token gaps are these steps (plus the hand-over to its client).
    step_hist_decode: list[int] = field(default_factory=new_hist)
    step_hist_prefill: list[int] = field(default_factory=new_hist)
    step_hist_mixed: list[int] = field(default_factory=new_hist)

    def reset(self) -> None:
        """Every counter back to zero, in place (the scheduler's parts share this object)."""
        self.__init__()


def scheduler_stats(sched) -> dict[str, Any]:
    alloc = sched.cache.allocator
    used = (alloc.num_pages - alloc.num_free) * alloc.page_size
    stats = _stats(sched, alloc, used)
    hstats = getattr(sched.cache.tree, "hstats", None)
    if hstats is not None:
        stats["hicache_host_tokens"] = sched.cache.tree.host_size
        stats["hicache_host_hit_tokens"] = hstats.host_hit_tokens
        stats["hicache_storage_hit_tokens"] = hstats.storage_hit_tokens
    manager = sched.lora.manager
    if manager is not None and sched.args.tokenizer_worker_num > 1:
        # the adapters loaded: each front end's registry follows them (engine._on_batch)
        stats["lora_refs"] = tuple(manager.infos.values())
    return stats


def _stats(sched, alloc, used: int) -> dict[str, Any]:
    return {
        "num_running_reqs": len(sched.decode.running) + (1 if sched.prefill.chunked_req else 0),
        "num_queued_reqs": len(sched.prefill.waiting),
        "kv_used_tokens": used,
        "kv_cached_tokens": sched.cache.tree.total_size if sched.cache.tree is not None else 0,
        "kv_cached_pages": (
            sched.cache.tree.total_size // alloc.page_size if sched.cache.tree is not None else 0
        ),
        "kv_total_tokens": alloc.num_pages * alloc.page_size,
        "kv_free_pages": alloc.num_free,
        "kv_total_pages": alloc.num_pages,
        "process_cpu_s": time.process_time(),  # the scheduler's process (CPU seconds)
        # the weights' path (update_weights_from_disk changes it): every front end reports it
        "model_path": sched.runner.model_path,
        # every SchedulerStats counter, by its field name (the histograms copied: an in-process
        # front end keeps this dict while the scheduler goes on counting)
        **{k: list(v) if type(v) is list else v for k, v in vars(sched.stats).items()},
    }
