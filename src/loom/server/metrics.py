"""Prometheus metrics of the front end (names follow SGLang's, with a ``loom:`` prefix).

With several front-end processes (``--tokenizer-worker-num``) every process records into
prometheus_client's multiprocess files in one directory and ``/metrics``, whichever process
answers it, reads them all: counters and histograms add up over the processes, and the load
gauges (the scheduler's figures, which every process receives) report the latest value set.
"""

from __future__ import annotations

import os
from typing import Any

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class Metrics:
    def __init__(self, model_name: str, multiprocess_dir: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

        self.multiprocess_dir = multiprocess_dir
        gauge_kw = {}
        if multiprocess_dir is not None:
            # prometheus_client's switch to its multiprocess values (read when a value is made)
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiprocess_dir
            if values.ValueClass is values.MutexValue:
                values.ValueClass = values.MultiProcessValue()
            gauge_kw["multiprocess_mode"] = "mostrecent"
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        kw = {"labelnames": labels, "registry": self.registry}

        def gauge(name, doc):
            return Gauge(name, doc, **kw, **gauge_kw).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, **kw).labels(model_name)

        def histogram(name, doc):
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, **kw).labels(model_name)

        self.num_running = gauge("loom:num_running_reqs", "Requests being decoded or prefilled")
        self.num_queued = gauge("loom:num_queued_reqs", "Requests waiting in the queue")
        self.kv_usage = gauge("loom:token_usage", "Fraction of KV cache tokens in use")
        self.kv_used = gauge("loom:kv_used_tokens", "KV cache tokens in use")
        self.cache_hit_rate = gauge(
            "loom:cache_hit_rate", "Prefix-cache hit rate (cached / prompt tokens)"
        )
        self.prompt_tokens = counter("loom:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("loom:generation_tokens", "Generated tokens")
        self.cached_tokens = counter("loom:cached_tokens", "Prompt tokens served from cache")
        self.requests = counter("loom:num_requests", "Finished requests")
        self.aborted = counter("loom:num_aborted_requests", "Aborted requests")
        self.ttft = histogram("loom:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("loom:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("loom:e2e_request_latency_seconds", "End-to-end request latency")
        self.hicache_host_tokens = gauge(
            "loom:hicache_host_tokens", "KV tokens held in the hierarchical cache's host tier"
        )
        self.hicache_host_hits = gauge(
            "loom:hicache_host_hit_tokens", "Prompt tokens loaded back from host memory (total)"
        )
        self.hicache_storage_hits = gauge(
            "loom:hicache_storage_hit_tokens", "Prompt tokens loaded from the storage tier (total)"
        )
        self._prompt_total = 0
        self._cached_total = 0

    def observe_load(self, stats: dict[str, Any]) -> None:
        if not stats:
            return
        self.num_running.set(stats["num_running_reqs"])
        self.num_queued.set(stats["num_queued_reqs"])
        self.kv_used.set(stats["kv_used_tokens"])
        self.kv_usage.set(stats["kv_used_tokens"] / max(1, stats["kv_total_tokens"]))
        if "hicache_host_tokens" in stats:
            self.hicache_host_tokens.set(stats["hicache_host_tokens"])
            self.hicache_host_hits.set(stats["hicache_host_hit_tokens"])
            self.hicache_storage_hits.set(stats["hicache_storage_hit_tokens"])

    def observe_outputs(self, pairs: list[tuple[Any, Any]], now: float) -> None:
        """A step's outputs, each with its request's state before the output is applied."""
        generated = 0
        for state, out in pairs:
            n = len(out.new_token_ids)
            if n:
                generated += n
                if state.last_token_time is None:
                    self.ttft.observe(now - state.start)
                else:
                    gap = (now - state.last_token_time) / n
                    for _ in range(n):
                        self.itl.observe(gap)
            if out.finished_reason is not None:
                self.requests.inc()
                if out.finished_reason.get("type") == "abort":
                    self.aborted.inc()
                self.e2e.observe(now - state.start)
                self.prompt_tokens.inc(out.prompt_tokens)
                self.cached_tokens.inc(out.cached_tokens)
                self._prompt_total += out.prompt_tokens
                self._cached_total += out.cached_tokens
                self.cache_hit_rate.set(self._cached_total / max(1, self._prompt_total))
        if generated:
            self.generation_tokens.inc(generated)

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)
