"""The scheduler: continuous batching over the paged KV pool.

Each ``step()`` picks one batch, runs it and turns sampled tokens into ``ReqOutput``s:

1. Aborts are applied (KV pages return to the pool at once).
2. Prefill first: the chunked request (if any) continues, then waiting requests are admitted in
   the schedule policy's order while they fit: a free request slot, the prefill token budget and
   enough free KV after reserving decode room for everyone running. A prompt longer than
   ``chunked_prefill_size`` is prefilled in chunks over several steps (one chunked request at a
   time).
3. Otherwise decode every running request by one token. If the pool cannot hold one more token
   per request, the request that has done the least work is *retracted*: its pages are freed and it
   goes back to the front of the queue with its output so far, to be re-prefilled later. Greedy
   output is unchanged by this.

Invariant (checked by ``check_kv_balance``): every page is free or owned by exactly one request.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom import plugins
from loom.layers.fused_ops import ROTARY_GROUPED_FROM
from loom.mem_cache.radix_cache import RadixCache
from loom.sampling.logits_processor import TokenHistory
from loom.sampling.penalties import PenaltyState, apply_penalties
from loom.sampling.sampler import (
    SamplingBatchInfo,
    apply_logits_processors,
    masked_argmax,
    sample,
)
from loom.sampling.sampling_params import SamplingParams
from loom.sampling.triton_sampling import (
    FusedPenalties,
    SamplingGraph,
    fused_sample,
    per_row_seeds,
)
from loom.sampling.triton_sampling import enabled as fused_sampling_enabled
from loom.scheduler.admission import peak_pages
from loom.scheduler.policy import NoPrefixCache
from loom.scheduler.request import Req, ReqOutput

if TYPE_CHECKING:
    from loom.config import ServerArgs
    from loom.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# How a grammar's bitmask is applied on a GPU: "auto" (an all-greedy batch without penalties or
# bias takes masked_argmax, PyTorch launches only; any other batch the fused sampling kernels),
# "fused" (always the fused kernels) or "library" (the grammar library's own kernel, then the
# plain sampler, for batches without penalties or bias). CPU: the library's kernel.
_GRAMMAR_MASK = os.environ.get("LOOM_GRAMMAR_MASK", "auto")
# CUDA graphs of the fused sampling kernels (SamplingGraph), off by default. They cut a call's host
# time from ~300 to ~15 us (bench/sampling_host.py on the H200, session 7), but the batch-32
# decode steps measured with and without them took the same time (0.57 s for 511 SmolLM2 steps,
# device-bound either way), and the one structured run with them on was much slower, for a
# cause not yet isolated (docs/benchmarks.md, session 7). LOOM_SAMPLING_GRAPH=1 turns them on.
_SAMPLING_GRAPH = os.environ.get("LOOM_SAMPLING_GRAPH", "0") == "1"
# The static logits of the sampling graphs kept for reuse across batches, at most (bytes)
_SHARED_GRAPH_BYTES = 256 << 20


@dataclass
class _ExtendItem:
    req: Req
    prefix_len: int
    extend_len: int
    decode: bool = False  # a running request's next token, mixed into a prefill batch

    @property
    def completes(self) -> bool:
        return self.prefix_len + self.extend_len == self.req.seq_len


@dataclass
class _Sampled:
    """One step's sampled ids (and, when asked for, their logprobs) on the device."""

    tokens: torch.Tensor  # [bs]
    logprobs: torch.Tensor | None = None  # [bs] log_softmax of the raw logits at the token
    top_values: torch.Tensor | None = None  # [bs, k]
    top_ids: torch.Tensor | None = None  # [bs, k]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class _InflightStep:
    """A launched decode (or prefill) step whose sampled tokens may still be on their way to
    the host."""

    reqs: list[Req]
    tokens: torch.Tensor  # [bs] on the device
    host: _Sampled  # host copies, filled by non-blocking copies
    event: torch.cuda.Event | None
    # CUDA: an event recorded before the step's forward (the device's start of the step) and
    # whether the step was launched while the one before it was still in flight
    begin: torch.cuda.Event | None = None
    chained: bool = False

    @classmethod
    def start(
        cls, reqs: list[Req], out: _Sampled, begin=None, chained: bool = False
    ) -> _InflightStep:
        host = _Sampled(
            *(
                None if t is None else _to_host(t)
                for t in (out.tokens, out.logprobs, out.top_values, out.top_ids)
            )
        )
        event = None
        if out.tokens.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=begin is not None)
            event.record()
        return cls(reqs, out.tokens, host, event, begin, chained)

    def host_results(self, stats: SchedulerStats | None = None) -> tuple[list[int], list]:
        if self.event is not None:
            t = time.perf_counter()
            self.event.synchronize()
            if stats is not None:
                stats.time_device_wait_s += time.perf_counter() - t
        return self.host.tokens.tolist(), _logprob_rows(self.host, len(self.reqs))


def _logprob_rows(s: _Sampled, bs: int) -> list:
    """Per row: None, or (logprob, [(logprob, id), ...] top entries)."""
    if s.logprobs is None:
        return [None] * bs
    lps = s.logprobs.tolist()
    tops = (
        [
            list(zip(v, i, strict=True))
            for v, i in zip(s.top_values.tolist(), s.top_ids.tolist(), strict=True)
        ]
        if s.top_values is not None
        else [[] for _ in range(bs)]
    )
    return [(lp, top) for lp, top in zip(lps, tops, strict=True)]


@dataclass
class _SamplingPlan:
    """One batch's sampling tensors on the device (see ``Scheduler._sampling_plan``)."""

    key: tuple
    info: SamplingBatchInfo
    seeded: list[int]  # rows with a sampling_seed
    want_logprobs: bool
    has_grammar: bool
    penalties: tuple | None = None  # see _build_sampling_plan
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # flat (row * vocab + token), values
    # On a GPU: penalties and bias applied by the sampling kernel itself (one launch a step)
    fused: FusedPenalties | None = None
    masked_argmax: bool = False  # an all-greedy grammar batch: sampler.masked_argmax
    # LOOM_SAMPLING_GRAPH=1, on CUDA: the fused kernels captured in a CUDA graph
    # on the plan's third step (the first compiles them; a batch that changes every step or
    # two, as requests come and go, never pays for a capture it would not replay)
    graph: SamplingGraph | None = None
    uses: int = 0
    row_seeds: torch.Tensor | None = None  # the graph's per-row seeds, from the first step


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_prefill_batches: int = 0
    num_decode_batches: int = 0
    num_overlapped_batches: int = 0  # decode steps launched before the previous one resolved
    # prefill steps launched before the previous prefill's first tokens were applied
    num_overlapped_prefill_batches: int = 0
    num_mixed_batches: int = 0  # prefill batches that also decoded the running requests
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_decode_tokens: int = 0  # the decode batches' sizes, summed
    # Host wall time inside step(), by the kind of batch the step ran, and the part of it spent
    # blocked on the device's results (near the step time: device-bound; near 0: host-bound).
    time_prefill_s: float = 0.0
    time_decode_s: float = 0.0
    time_device_wait_s: float = 0.0
    time_grammar_wait_s: float = 0.0  # idle steps waiting only for grammar compiles
    # CUDA graphs of the sampling kernels (LOOM_SAMPLING_GRAPH=1) captured, and the host time
    # the captures took (a batch that changes often pays one every few steps)
    num_sampling_graph_captures: int = 0
    time_sampling_graph_capture_s: float = 0.0
    num_sampling_graph_adoptions: int = 0  # a new batch served by an earlier batch's graph
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


class Scheduler:
    def __init__(
        self, server_args: ServerArgs, runner: ModelRunner, eos_token_ids: set[int]
    ) -> None:
        self.args = server_args
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.allocator = runner.allocator
        self.req_to_token_pool = runner.req_to_token_pool
        self.page_size = server_args.page_size
        self.context_len = runner.model_config.context_len
        self.max_running = runner.max_running_requests
        chunk = server_args.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if runner.device.type == "cuda" else 1024
        self.chunk_size = math.inf if chunk == -1 else max(chunk, self.page_size)
        self.max_prefill_tokens = server_args.max_prefill_tokens
        policy_cls = plugins.resolve("schedule_policy", server_args.schedule_policy)
        self.policy = policy_cls(seed=server_args.random_seed)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._aborts: set[str] = set()
        self.init_new_token_ratio = min(1.0, 0.7 * server_args.schedule_conservativeness)
        self.min_new_token_ratio = min(
            self.init_new_token_ratio, 0.14 * server_args.schedule_conservativeness
        )
        self.new_token_ratio = self.init_new_token_ratio
        self.stats = SchedulerStats()
        # Overlap scheduling: on CUDA the host prepares step N+1 while the device runs step N.
        self.overlap = runner.device.type == "cuda" and not server_args.disable_overlap_schedule
        # The radix prefix cache: finished requests leave their KV in it; new ones match it.
        self.tree: RadixCache | None = None
        if not server_args.disable_radix_cache:
            policy = plugins.resolve("radix_eviction_policy", server_args.radix_eviction_policy)
            # Every policy takes keyword options; those it does not use are ignored.
            options = {"protected_threshold": server_args.slru_protected_threshold}
            if server_args.enable_hierarchical_cache:
                self.tree = self._build_hicache(policy(**options))
            else:
                self.tree = RadixCache(self._free_tree_slots, policy(**options), self.page_size)
        self._inflight: _InflightStep | None = None
        # Overlap: a prefill step whose sampled first tokens are still on their way; the next
        # prefill launches before they are applied (its requests already count as running)
        self._inflight_prefill: _InflightStep | None = None
        # CUDA: decode steps are timed on the device (SchedulerStats.time_device_*)
        self._time_device = runner.device.type == "cuda"
        self._decode_begin: torch.cuda.Event | None = None
        self._last_decode_end: torch.cuda.Event | None = None
        # Structured output: requests whose grammar is compiling wait here, off the batch.
        self.grammar_queue: list[Req] = []
        self.grammar_mgr = None
        self.penalties: PenaltyState | None = None  # allocated with the first penalised request
        self._plan_cache: _SamplingPlan | None = None
        self._tail_s = 0.0  # this step's wait for the previous (overlapped) decode step
        self._sampling_graphs = (
            _SAMPLING_GRAPH and runner.device.type == "cuda" and not server_args.disable_cuda_graph
        )
        # sampling graphs of batches without penalties or bias (grammar batches), by batch shape
        # and kernel variant, least recently used first: a new batch of the same kind adopts one
        # instead of capturing
        self._shared_graphs: OrderedDict[tuple, SamplingGraph] = OrderedDict()
        self._mask_bufs: list[torch.Tensor] | None = None  # pinned grammar bitmasks (CUDA)
        self._mask_flip = 0
        # Failure isolation: every request the scheduler holds whose last output has not left
        # a step yet (a failed step fails these, so none is lost), the outputs of requests
        # failed inside a step, and the steps failed in a row.
        self._live: dict[str, Req] = {}
        self._failed: list[ReqOutput] = []
        self._failed_steps = 0

    def _build_hicache(self, policy):
        import json

        from loom.mem_cache.hiradix_cache import HiRadixCache, KVTransfer

        args, runner = self.args, self.runner
        pool = runner.kv_pool
        per_token = pool.bytes_per_token(
            len(pool.k_buffers), pool.num_kv_heads, pool.head_dim, pool.dtype
        )
        if args.hicache_size > 0:
            host_tokens = int(args.hicache_size * 1e9 // per_token)
        else:
            host_tokens = int(args.hicache_ratio * runner.max_total_tokens)
        storage = None
        if args.hicache_storage_backend:
            extra = json.loads(args.hicache_storage_backend_extra_config or "{}")
            cls = plugins.resolve("hicache_storage", args.hicache_storage_backend)
            storage = cls(self._storage_namespace(), **extra)
            if self.page_size < 8:
                logger.warning(
                    "--hicache-storage-backend stores one entry per page: with --page-size %d "
                    "that is %d tokens per entry; 16-64 is usual",
                    self.page_size,
                    self.page_size,
                )
        logger.info(
            "hierarchical cache: host tier %d tokens (%.1f MB), %s, storage %s",
            host_tokens,
            host_tokens * per_token / 2**20,
            args.hicache_write_policy,
            args.hicache_storage_backend or "none",
        )
        return HiRadixCache(
            self._free_tree_slots,
            policy,
            self.page_size,
            alloc_slots=self._alloc_tree_slots,
            transfer=KVTransfer(pool),
            host_capacity_tokens=host_tokens,
            write_policy=args.hicache_write_policy,
            storage=storage,
        )

    def _storage_namespace(self) -> str:
        """The model's weights and the KV layout: stores are shared only between identical
        ones, wherever the model is installed (the path itself does not count)."""
        import hashlib
        import re

        pool = self.runner.kv_pool
        cfg = self.runner.model_config
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(cfg.architecture))
        layout = (
            f"{model_fingerprint(str(cfg.path))}|{cfg.architecture}|{pool.dtype}|"
            f"L{len(pool.k_buffers)}|H{pool.num_kv_heads}|D{pool.head_dim}|P{self.page_size}|"
            f"{self.args.load_format}|seed{self.args.random_seed}"
        )
        return f"{name[:48]}-{hashlib.sha256(layout.encode()).hexdigest()[:16]}"

    def _alloc_tree_slots(self, num_tokens: int) -> list[int] | None:
        ps = self.page_size
        pages = self._alloc_pages(num_tokens // ps)
        if pages is None:
            return None
        return [p * ps + i for p in pages for i in range(ps)]

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()
        if self.grammar_mgr is not None:
            self.grammar_mgr.close()

    # ---- intake ---------------------------------------------------------------------------

    def add_request(self, req: Req) -> list[ReqOutput]:
        """Queue ``req``; its outputs if it ends at once (refused, or nothing to generate). An
        exception fails this request alone."""
        try:
            outputs = self._add_request(req)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            logger.exception("request %s failed on arrival", req.rid)
            self.waiting = deque(r for r in self.waiting if r is not req)
            self.grammar_queue = [r for r in self.grammar_queue if r is not req]
            return [self._fail(req, f"internal error: {type(e).__name__}: {e}", 500)]
        if not outputs:
            self._live[req.rid] = req
        return outputs

    def _add_request(self, req: Req) -> list[ReqOutput]:
        if req.lora_name is not None:
            lora = self.runner.lora_manager
            if lora is None:
                return [self._fail(req, "LoRA adapters are not enabled (--lora-paths)")]
            if not lora.has(req.lora_name):
                return [
                    self._fail(
                        req,
                        f"unknown LoRA adapter {req.lora_name!r}; loaded: "
                        f"{', '.join(lora.names) or 'none'}",
                    )
                ]
            req.extra_key = lora.cache_namespace(req.lora_name, req.extra_key)
        if req.sampling_params.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return [self._output(req, [])]
        constraint = req.sampling_params.constraint
        if constraint is not None:
            try:
                req.grammar_future = self._grammar().submit(*constraint)
            except Exception as e:  # noqa: BLE001 - no tokenizer, bad backend options
                return [self._fail(req, f"structured output unavailable: {e}")]
            req.grammar_deadline = time.monotonic() + self.args.grammar_compile_timeout
            self.grammar_queue.append(req)
            return []
        self.waiting.append(req)
        return []

    def _grammar(self):
        if self.grammar_mgr is None:
            from loom.constrained.manager import GrammarManager, build_grammar_backend

            args, runner = self.args, self.runner
            stop = set(self.eos_token_ids)

            def make():
                path = args.tokenizer_path or runner.model_path
                tokenizer = runner.loader.load_tokenizer(path)
                if tokenizer is None:
                    raise ValueError(f"no tokenizer at {path}")
                return build_grammar_backend(args, tokenizer, runner.vocab_size, stop)

            self.grammar_mgr = GrammarManager(make)
        return self.grammar_mgr

    def _poll_grammars(self) -> list[ReqOutput]:
        """Move requests whose grammar compiled to the waiting queue; fail the others."""
        if not self.grammar_queue:
            return []
        outputs, still = [], []
        now = time.monotonic()
        for req in self.grammar_queue:
            fut = req.grammar_future
            if fut.done():
                try:
                    req.grammar = self.grammar_mgr.backend.matcher(fut.result())
                except Exception as e:  # noqa: BLE001 - GrammarError or the library's own
                    outputs.append(self._fail(req, f"grammar compilation failed: {e}"))
                    continue
                req.grammar_future = None
                self.waiting.append(req)
            elif now > req.grammar_deadline:
                outputs.append(
                    self._fail(
                        req,
                        f"grammar compilation timed out after {self.args.grammar_compile_timeout} s",
                    )
                )
            else:
                still.append(req)
        self.grammar_queue = still
        return outputs

    def _fail(self, req: Req, message: str, status: int = 400) -> ReqOutput:
        """End a request that holds no KV with an error (``status``: the HTTP status its client
        gets: 400 for what the request asked, 500 for a failure of Loom's own)."""
        req.error = message
        req.finished_reason = {"type": "abort", "message": message, "status_code": status}
        return self._output(req, [])

    def _fail_in_step(self, req: Req, error: BaseException | str, status: int = 500) -> None:
        """Fail one request inside a step: it leaves every queue, its KV pages, request row,
        penalty row and adapter slot return, and its error output goes out with the step's.
        A step in flight that still computes its row discards that row's token."""
        if isinstance(error, BaseException):
            logger.error("request %s failed: %s: %s", req.rid, type(error).__name__, error)
            error = f"internal error: {type(error).__name__}: {error}"
        if req.is_finished:
            return
        self.waiting = deque(r for r in self.waiting if r is not req)
        self.running = [r for r in self.running if r is not req]
        if self.chunked_req is req:
            self.chunked_req = None
        self._release(req)
        self._release_penalty(req)
        self._failed.append(self._fail(req, error, status))

    def _recover(self, error: Exception) -> list[ReqOutput]:
        """After a step raised: fail the requests it may have touched (all that hold KV or
        were in flight; after three failed steps in a row, the queued ones too), return their
        pages and carry on. Raises if the state cannot be made whole again (the pages do not
        balance, or the device itself failed): the loop then dies and every request ends with
        the scheduler's error."""
        logger.exception("a scheduler step failed; failing its requests")
        self._failed_steps += 1
        message = f"internal error in the scheduler: {type(error).__name__}: {error}"
        queued = {id(r) for r in self.waiting} | {id(r) for r in self.grammar_queue}
        if self._failed_steps >= 3:
            queued = set()
            self.waiting, self.grammar_queue = deque(), []
        self._inflight = self._inflight_prefill = None
        self._decode_begin = None
        self._plan_cache = None
        self.running, self.chunked_req = [], None
        outputs, self._failed = self._failed, []
        for req in list(self._live.values()):
            if id(req) in queued:
                continue
            self._release(req)
            self._release_penalty(req)
            if req.grammar_future is not None:
                req.grammar_future.cancel()
            outputs.append(self._fail(req, message, 500))
            del self._live[req.rid]
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()  # a device fault is sticky: it raises here, and is fatal
        self.check_kv_balance()
        return outputs

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.chunked_req
            or self._aborts
            or self._inflight is not None
            or self._inflight_prefill is not None
            or self.grammar_queue
        )

    # ---- start-up warm-up -----------------------------------------------------------------

    # Sampling parameters of the warm-up's rounds: each round is its own batch, so each takes
    # its own path (argmax; fused kernels with and without the top-p search; with penalties and
    # logit bias; min_new_tokens' bias rows).
    _WARMUP_ROUNDS = (
        {"temperature": 0.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.7},
        {
            "temperature": 0.8,
            "top_p": 0.95,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.2,
            "repetition_penalty": 1.1,
            "logit_bias": {"3": -1.0},
        },
        {"temperature": 0.0, "min_new_tokens": 2},
        {"temperature": 0.7, "top_p": 0.9, "seed": 1},  # seeded rows draw from their own seeds
    )

    @torch.inference_mode()
    def warmup(self) -> None:
        """Run a few throwaway requests through the paths a first request takes, so that
        Triton compiles its kernels now and not inside the first requests (on the H200 the
        first sampled requests paid 2-5 s; docs/benchmarks.md, session 8). Prompts of 16, 21
        and 1 tokens cover the three ways Triton specialises a token count (a multiple of 16,
        neither, one); one past the rotary kernel's switch to head groups covers its prefill
        variant (a first 124-token request compiled it on the H200: +118 ms, session 11); the
        rounds cover the sampling paths. Afterwards the prefix cache is empty, every page is
        free and the counters start from zero."""
        vocab = self.runner.vocab_size
        greedy = {"temperature": 0.0}
        rounds = [(16, greedy), (1, greedy), (ROTARY_GROUPED_FROM + 5, greedy)]
        rounds += [(21, extra) for extra in self._WARMUP_ROUNDS]
        # without the prefix cache: nothing of the warm-up may reach a cache tier (the
        # hierarchical cache's storage persists across restarts)
        tree, self.tree = self.tree, None
        try:
            for i, (n, extra) in enumerate(rounds):
                for j in range(2):
                    ids = [(7 + 13 * (k + j)) % vocab for k in range(n)]
                    params = SamplingParams.from_dict(
                        {"max_new_tokens": 3, "ignore_eos": True, **extra}
                    )
                    params.validate(vocab)
                    self.add_request(Req(f"loom-warmup-{i}-{j}", ids, params))
                while self.has_work:
                    self.step()
        finally:
            self.tree = tree
        self.check_kv_balance()
        self._plan_cache = None
        self.new_token_ratio = self.init_new_token_ratio
        self.stats = SchedulerStats()

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        t = time.perf_counter()
        prefills = self.stats.num_prefill_batches
        waited = self.stats.time_grammar_wait_s
        self._tail_s = self._prefill_tail_s = 0.0
        try:
            outputs = self._step()
            self._failed_steps = 0
        except Exception as e:  # noqa: BLE001 - one step's failure is not the server's
            outputs = self._recover(e)
        if self._failed:
            outputs += self._failed
            self._failed = []
        for out in outputs:
            if out.finished_reason is not None:
                self._live.pop(out.rid, None)
        dt = time.perf_counter() - t - (self.stats.time_grammar_wait_s - waited)
        if self.stats.num_prefill_batches != prefills:
            # the wait for the decode step still in flight belongs to decode, not to the
            # prefill that follows it
            self.stats.time_prefill_s += dt - self._tail_s
            self.stats.time_decode_s += self._tail_s
        else:  # and the wait for a prefill still in flight, to prefill
            self.stats.time_decode_s += dt - self._prefill_tail_s
            self.stats.time_prefill_s += self._prefill_tail_s
        return outputs

    def _step(self) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        if self._inflight is not None:
            if self._can_chain():
                # Overlap: launch decode N+1 on N's device-side tokens, then bring N's tokens to
                # the host while the device works.
                if self._host_before_sampling():
                    # Grammars and logits processors need N's tokens before N+1 is sampled:
                    # only the forward runs ahead; N is resolved (matchers advance, masks fill)
                    # while the device computes N+1's logits.
                    logits, reqs = self._forward_decode(chained=True)
                    outputs += self._resolve(self._inflight)
                    nxt = self._start_sampling(logits, reqs, pending=0)
                else:
                    nxt = self._launch_decode(chained=True)
                    outputs += self._resolve(self._inflight)
                self.stats.num_overlapped_batches += 1
                self._inflight = nxt
                return outputs
            t = time.perf_counter()
            outputs += self._resolve(self._inflight)
            self._tail_s = time.perf_counter() - t
            self._inflight = None
        outputs += self._poll_grammars()
        outputs += self._apply_aborts()
        items = self._schedule_extend()
        if self._inflight_prefill is not None:
            pending, self._inflight_prefill = self._inflight_prefill, None
            if items and self._may_defer(items):
                # Overlap: launch this prefill, then apply the previous one's first tokens
                # while the device works (nothing here depends on them)
                outputs += self._run_extend(items, defer=True)
                outputs += self._resolve_prefill(pending)
                self.stats.num_overlapped_prefill_batches += 1
                return outputs
            t = time.perf_counter()
            outputs += self._resolve_prefill(pending)
            self._prefill_tail_s = time.perf_counter() - t
        if items:
            if self.args.enable_mixed_chunk and self.running:
                items += self._mixed_decode_items()
            outputs += self._run_extend(items, defer=self.overlap and self._may_defer(items))
        elif self.running:
            outputs += self._ensure_decode_room()
            if self.running:
                self._inflight = self._launch_decode(chained=False)
                if not self.overlap:
                    outputs += self._resolve(self._inflight)
                    self._inflight = None
        elif self.grammar_queue and not outputs:
            # Only compiles are pending: wait a little for one instead of spinning.
            from concurrent.futures import FIRST_COMPLETED, wait

            t = time.perf_counter()
            wait([r.grammar_future for r in self.grammar_queue], 0.005, FIRST_COMPLETED)
            self.stats.time_grammar_wait_s += time.perf_counter() - t
        return outputs

    def _mixed_decode_items(self) -> list[_ExtendItem]:
        """``--enable-mixed-chunk``: the running requests decode one token inside the prefill
        batch (an extend of one token over their cached KV) instead of waiting for it, which
        keeps inter-token latency flat while long prompts prefill. Skipped when the pool could
        not give every running request its next slot without evicting or retracting."""
        if self._decode_pages_needed() > self.allocator.num_free:
            return []
        items = []
        for req in self.running:
            if self._alloc_kv(req, 1) is None:  # cannot happen: room was checked
                raise AssertionError("mixed decode slot")
            items.append(_ExtendItem(req, req.kv_len, 1, decode=True))
        self.stats.num_mixed_batches += 1
        return items

    # ---- aborts ---------------------------------------------------------------------------

    def _apply_aborts(self) -> list[ReqOutput]:
        if not self._aborts:
            return []
        outputs = []
        rids, self._aborts = self._aborts, set()
        for req in [r for r in self.grammar_queue if r.rid in rids]:
            self.grammar_queue.remove(req)
            req.finished_reason = {"type": "abort", "message": "aborted"}
            outputs.append(self._output(req, []))
        for queue in (self.waiting, self.running):
            for req in [r for r in queue if r.rid in rids]:
                queue.remove(req)
                outputs.append(self._finish_abort(req))
        if self.chunked_req is not None and self.chunked_req.rid in rids:
            outputs.append(self._finish_abort(self.chunked_req))
            self.chunked_req = None
        return outputs

    def _finish_abort(self, req: Req, message: str = "aborted") -> ReqOutput:
        self._release(req)
        self._release_penalty(req)
        req.finished_reason = {"type": "abort", "message": message}
        return self._output(req, [])

    # ---- KV bookkeeping -------------------------------------------------------------------

    def _alloc_kv(self, req: Req, num_tokens: int, write: bool = True) -> list[int] | None:
        """Slots for positions [kv_len, kv_len + num_tokens) of ``req``; None if out of pages.

        With ``write`` they are also written into the request's row of the req-to-token table;
        decode leaves that to the model runner, which writes the whole batch in one copy."""
        ps = self.page_size
        start, end = req.kv_len, req.kv_len + num_tokens
        need = -(-end // ps) - len(req.kv_pages)
        if need > 0:
            pages = self._alloc_pages(need)
            if pages is None:
                return None
            req.kv_pages.extend(pages)
        pages = req.kv_pages
        locs = [pages[p // ps] * ps + p % ps for p in range(start, end)]
        if write:
            table = self.req_to_token_pool.req_to_token
            table[req.req_pool_idx, start:end] = torch.tensor(locs, dtype=torch.int64).to(
                table.device, non_blocking=True
            )
        return locs

    def load_lora(self, name: str, path: str) -> str | None:
        """Load an adapter while serving; the error message, or None."""
        lora = self.runner.lora_manager
        if lora is None:
            return "LoRA is off: start the engine with --enable-lora or --lora-paths"
        try:
            lora.add(name, path)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    def unload_lora(self, name: str) -> str | None:
        """Unload an adapter no queued or running request uses; the error message, or None."""
        lora = self.runner.lora_manager
        if lora is None:
            return "LoRA is off: start the engine with --enable-lora or --lora-paths"
        if not lora.has(name):
            return f"unknown LoRA adapter {name!r}; loaded: {', '.join(lora.names) or 'none'}"
        users = [
            r.rid
            for r in (*self.running, *self.waiting, *self.grammar_queue)
            if r.lora_name == name
        ]
        if self.chunked_req is not None and self.chunked_req.lora_name == name:
            users.append(self.chunked_req.rid)
        if users:
            return (
                f"LoRA adapter {name!r} is in use by {len(users)} request(s); retry when they end"
            )
        lora.remove(name)
        return None

    def _acquire_lora(self, req: Req) -> bool:
        lora = self.runner.lora_manager
        if not lora.acquire(req.lora_name):
            return False
        req.lora_slot = lora.slot_of(req.lora_name)
        return True

    def _release(self, req: Req, cache: bool = False) -> None:
        """Give back the request's KV. With ``cache`` (and a radix cache), its computed KV is
        inserted into the tree, which takes the pages it did not already hold; every other own
        page returns to the allocator. The matched prefix is unlocked."""
        ps = self.page_size
        own = req.kv_pages[req.num_shared_pages :]
        first_own = req.num_shared_pages  # page index of own[0] within the request
        if own and self.tree is not None and cache and req.req_pool_idx is not None:
            n = req.kv_len - req.kv_len % ps
            if n > 0:
                dup = self._insert_computed(req, n)
                # The tree took our full pages but the duplicates; the partial page past n is
                # ours to free too.
                self.allocator.free(
                    [p for i, p in enumerate(own, first_own) if i >= n // ps or p in dup]
                )
                own = []
        if own:
            self.allocator.free(own)
        if req.prefix_node is not None:
            self.tree.dec_lock_ref(req.prefix_node)
            req.prefix_node = None
        req.kv_pages = []
        req.num_shared_pages = 0
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0
        if req.lora_slot >= 0:
            self.runner.lora_manager.release(req.lora_name)
            req.lora_slot = -1

    def _input_logprobs(self, items, wants, logits, last_rows) -> None:
        """Logprobs of prompt tokens from this chunk's logits: the logits at position q give
        the logprob of token q + 1 (token 0 has none)."""
        start_row = 0
        for it, w, last in zip(items, wants, last_rows, strict=True):
            rows_start = start_row
            start_row = last + 1
            if not w:
                continue
            req = it.req
            prompt = req.origin_input_ids
            s, e = it.prefix_len, it.prefix_len + it.extend_len
            acc = req.input_logprob_acc
            if s == 0 and req.logprob_start_len == 0:
                acc.append((None, prompt[0]))
            qs = [q for q in range(s, min(e, len(prompt) - 1)) if q + 1 >= req.logprob_start_len]
            if qs:
                rows = torch.tensor([rows_start + q - s for q in qs], device=logits.device)
                toks = torch.tensor([prompt[q + 1] for q in qs], device=logits.device)
                lsm = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
                vals = lsm.gather(1, toks.unsqueeze(1)).squeeze(1).tolist()
                acc += [(v, prompt[q + 1]) for v, q in zip(vals, qs, strict=True)]
            if e >= len(prompt):
                req.pending_input_logprobs, req.input_logprob_acc = acc, []

    def _insert_computed(self, req: Req, n: int) -> set[int]:
        """Insert the request's first ``n`` (page-aligned) tokens' KV into the tree; returns the
        pages the tree did not take (duplicates of what it already held)."""
        ps = self.page_size
        # From the request's pages, as _alloc_kv laid them out: reading its row of the device
        # table would wait for every step queued, under overlap the in-flight one too.
        pages = req.kv_pages
        slots = [pages[i // ps] * ps + i % ps for i in range(n)]
        back = self.tree.cache(req.fill_ids[:n], slots, req.extra_key, req.priority)
        return {s // ps for s in back}

    def _cache_unfinished(self, req: Req) -> None:
        """After a prefill (a chunk, or the whole prompt) the request inserts what it has
        computed, so that requests sharing the prefix can match it before this one finishes; it
        then holds the tree's path (locked) instead of its own pages for that part."""
        if self.tree is None:
            return
        ps = self.page_size
        n = req.kv_len - req.kv_len % ps
        if n <= req.num_shared_pages * ps:
            return
        back = self._insert_computed(req, n)
        # Own pages the tree did not take duplicate what another request cached meanwhile.
        dup = [
            p
            for i, p in enumerate(req.kv_pages)
            if req.num_shared_pages <= i < n // ps and p in back
        ]
        new_slots, node = self.tree.cached_path(req.fill_ids[:n], req.extra_key)
        table = self.req_to_token_pool.req_to_token
        self.tree.inc_lock_ref(node)
        if req.prefix_node is not None:
            self.tree.dec_lock_ref(req.prefix_node)
        req.prefix_node = node
        self.allocator.free(dup)
        req.kv_pages = [s // ps for s in new_slots[::ps]] + req.kv_pages[n // ps :]
        req.num_shared_pages = n // ps
        if dup:
            table[req.req_pool_idx, :n] = torch.tensor(new_slots, dtype=torch.int64).to(
                table.device, non_blocking=True
            )

    def _free_tree_slots(self, slots: list[int]) -> None:
        ps = self.page_size
        self.allocator.free(sorted({s // ps for s in slots}))

    def _alloc_pages(self, n: int) -> list[int] | None:
        """``n`` pages, evicting unlocked radix-cache leaves if the allocator runs short."""
        if n > self.allocator.num_free and self.tree is not None:
            self.tree.evict((n - self.allocator.num_free) * self.page_size)
        return self.allocator.alloc(n)

    def _evictable_pages(self) -> int:
        return self.tree.evictable_size // self.page_size if self.tree is not None else 0

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when idle (running requests may hold matched paths)."""
        if self.tree is None:
            return True
        if self.has_work:
            return False
        self.tree.flush()
        return True

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _admission_room(self) -> int:
        """Pages a new request may take: free and evictable ones, less those kept for requests
        already admitted."""
        return self.allocator.num_free + self._evictable_pages() - self._reserved_pages()

    def _pages_to_admit(self, req: Req, matched_tokens: int) -> int:
        """Pages admitting ``req`` reserves: its tokens so far plus its expected output, less
        the ``matched_tokens`` of its prefix already in the cache."""
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        need = self._pages_for(req.seq_len + math.ceil(remaining * self.new_token_ratio))
        return need - matched_tokens // self.page_size

    def _growth_left(self, req: Req) -> int:
        """Tokens ``req`` may still add to its KV: its output budget left, plus one (a request
        finishing by length decodes one step past its last token when steps chain)."""
        return max(req.sampling_params.max_new_tokens - len(req.output_ids), 0) + 1

    def _peak_rows(self, reqs) -> tuple[list[int], list[int], list[int], int]:
        """``reqs``' rows for ``admission.peak_pages`` (tokens, growth left, shared pages) and
        the pages they own now."""
        tokens, growth, shared, owned = [], [], [], 0
        for r in reqs:
            tokens.append(r.seq_len)
            growth.append(self._growth_left(r))
            shared.append(r.num_shared_pages)
            owned += len(r.kv_pages) - r.num_shared_pages
        return tokens, growth, shared, owned

    def _fits_at_peak(self, rows, extra: list[Req], cand: tuple[int, int, int], held: int) -> bool:
        """Whether the admitted requests (``rows``: the running ones; ``extra``: those admitted
        this step) and a candidate row (tokens, growth left, shared pages) fit the pool at
        every future step, each running to its ``max_new_tokens``: admitting it can then never
        force a retraction. ``held``: pages of the pool's room the candidate's matched prefix
        takes (locked, no longer evictable)."""
        tokens, growth, shared, owned = rows
        t2, g2, s2, o2 = self._peak_rows(extra)
        room = self.allocator.num_free + self._evictable_pages() + owned + o2 - held
        peak = peak_pages(
            tokens + t2 + [cand[0]],
            growth + g2 + [cand[1]],
            shared + s2 + [cand[2]],
            self.page_size,
        )
        return peak <= room

    def _reserved_pages(self) -> int:
        """Pages to keep free for requests already admitted (decode room and unfilled prompts)."""
        total = 0
        reqs = self.running + ([self.chunked_req] if self.chunked_req else [])
        for req in reqs:
            remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
            future = req.seq_len - req.kv_len + math.ceil(remaining * self.new_token_ratio)
            total += self._pages_for(req.kv_len + future) - len(req.kv_pages)
        return total

    def check_kv_balance(self) -> None:
        owners = (
            self.running + list(self.waiting) + ([self.chunked_req] if self.chunked_req else [])
        )
        owned = sum(len(r.kv_pages) - r.num_shared_pages for r in owners)
        if self.tree is not None:
            owned += self.tree.total_size // self.page_size
        free = self.allocator.num_free
        if free + owned != self.allocator.num_pages:
            raise AssertionError(
                f"KV pages do not balance: {free} free + {owned} owned != "
                f"{self.allocator.num_pages}"
            )
        lora = self.runner.lora_manager
        if lora is not None:  # and each adapter slot is held by exactly its requests
            held: dict[str, int] = {}
            for r in owners:
                if r.lora_slot >= 0:
                    held[r.lora_name] = held.get(r.lora_name, 0) + 1
                    if lora.slot_names[r.lora_slot] != r.lora_name:
                        raise AssertionError(
                            f"request {r.rid} holds slot {r.lora_slot} of another adapter"
                        )
            refs = {n: c for n, c in lora.refs.items() if c}
            if held != refs:
                raise AssertionError(f"LoRA slots do not balance: held {held}, counted {refs}")

    # ---- prefill --------------------------------------------------------------------------

    def _schedule_extend(self) -> list[_ExtendItem]:
        items: list[_ExtendItem] = []
        # One prefill step computes at most chunked_prefill_size prompt tokens in all (SGLang's
        # semantics), so a burst of prompts cannot stall running requests for long.
        budget = min(self.max_prefill_tokens, self.chunk_size)
        if self.chunked_req is not None:
            req = self.chunked_req
            n = int(min(req.seq_len - req.kv_len, self.chunk_size, budget))
            if self._alloc_kv(req, n) is None:
                return []  # wait for running requests to free pages
            items.append(_ExtendItem(req, req.kv_len, n))
            budget -= n
            if req.kv_len + n == req.seq_len:
                self.chunked_req = None
            else:
                return items
        if not self.waiting:
            return items
        ordered = self.policy.order(list(self.waiting), self._prefix_view)
        free_pages = self._admission_room()
        num_active = len(self.running) + len(items)
        admitted_prompts: set[int] = set()
        running_rows = None  # the running requests' rows for the peak bound, on first use
        lora_blocked = False
        for req in ordered:
            if budget <= 0 or num_active >= self.max_running:
                break
            if self.req_to_token_pool.num_free == 0:
                break
            try:
                if (
                    self.tree is not None
                    and not req.output_ids
                    and len(req.origin_input_ids) > self.page_size
                ):
                    # n > 1 (or any identical prompts arriving together): prefill the prompt once;
                    # the others wait one step and match its KV in the radix cache.
                    if req.prompt_hash in admitted_prompts:
                        continue
                    admitted_prompts.add(req.prompt_hash)
                slots, node = self._match(req)
                need = self._pages_to_admit(req, len(slots))
                # Alone, a request needs only its prompt plus one token of room: if it later
                # outgrows the pool it is aborted with a clear message rather than starved.
                alone = not self.running and not items
                room = self.allocator.num_free + self._evictable_pages()
                if need > free_pages and not (
                    alone and room >= self._pages_for(req.seq_len + 1 - len(slots))
                ):
                    # Beyond the expected pages, admit what fits even if everything runs to its
                    # limit (no retraction can follow; admission.py)
                    if running_rows is None:
                        running_rows = self._peak_rows(self.running)
                    shared = len(slots) // self.page_size
                    cand = (req.seq_len, self._growth_left(req), shared)
                    if not self._fits_at_peak(running_rows, [it.req for it in items], cand, shared):
                        break
                if req.lora_name is not None and (lora_blocked or not self._acquire_lora(req)):
                    # Every adapter slot is busy with other running adapters. Base-model requests
                    # may pass it, adapter requests may not: the adapters holding the slots then
                    # drain, and this one gets a slot (no adapter starves behind a busy one).
                    lora_blocked = True
                    continue
                req.req_pool_idx = self.req_to_token_pool.alloc()
                evictable_before = self._evictable_pages()
                self._use_prefix(req, slots, node)
                locked = evictable_before - self._evictable_pages()
                n = int(min(req.seq_len - req.kv_len, self.chunk_size, budget))
                if self._alloc_kv(req, n) is None:
                    self._release(req)
                    break
                self.waiting.remove(req)
                free_pages -= need + locked
                budget -= n
                num_active += 1
                items.append(_ExtendItem(req, req.kv_len, n))
                if req.kv_len + n < req.seq_len:
                    self.chunked_req = req
                    break
            except Exception as e:  # noqa: BLE001 - this request's arithmetic or state
                self._fail_in_step(req, e)
        return items

    @property
    def _prefix_view(self):
        return self if self.tree is not None else NoPrefixCache()

    def match(self, req: Req) -> tuple[int, object]:
        """The schedule policies' read-only view of the prefix cache (``PrefixView``)."""
        return self.tree.peek_prefix(req.fill_ids[: req.seq_len - 1], req.extra_key)

    def _match(self, req: Req) -> tuple[list[int], object]:
        """The cached prefix of the request's tokens, leaving at least one token to compute."""
        if self.tree is None:
            return [], None
        key = req.fill_ids[: req.seq_len - 1]
        if req.wants_input_logprobs:  # prompt logprobs need the logits from logprob_start_len - 1
            key = key[: max(req.logprob_start_len - 1, 0)]
        if hasattr(self.tree, "match_and_load"):
            return self.tree.match_and_load(key, req.extra_key)
        return self.tree.match_prefix(key, req.extra_key)

    def _use_prefix(self, req: Req, slots: list[int], node) -> None:
        """Start the request on a matched prefix: lock it and point its table row at it."""
        req.cached_tokens = len(slots)
        if not slots:
            return
        ps = self.page_size
        self.tree.inc_lock_ref(node)
        req.prefix_node = node
        req.kv_pages = [s // ps for s in slots[::ps]]
        req.num_shared_pages = len(req.kv_pages)
        req.kv_len = len(slots)
        table = self.req_to_token_pool.req_to_token
        table[req.req_pool_idx, : len(slots)] = torch.tensor(slots, dtype=torch.int64).to(
            table.device, non_blocking=True
        )

    def _may_defer(self, items: list[_ExtendItem]) -> bool:
        """Whether a prefill step's first tokens may be applied a step later (overlap): not when
        it computes prompt logprobs, nor with ``--enable-mixed-chunk`` (the running requests
        decode inside prefill steps and need their tokens applied)."""
        if self.args.enable_mixed_chunk:
            return False
        return not any(it.req.wants_input_logprobs for it in items)

    def _run_extend(self, items: list[_ExtendItem], defer: bool = False) -> list[ReqOutput]:
        """One prefill step. ``defer``: launch it and leave its sampled first tokens in flight
        (``_inflight_prefill``, applied by the next step); its requests join ``running`` now, so
        that admission counts them."""
        self.stats.num_prefill_batches += 1
        input_ids, positions = [], []
        for it in items:
            input_ids += it.req.fill_ids[it.prefix_len : it.prefix_len + it.extend_len]
            positions += range(it.prefix_len, it.prefix_len + it.extend_len)
        reqs = [it.req for it in items]
        # Prompt logprobs: all of a request's new tokens' logits, not just the last one's.
        wants = [it.req.wants_input_logprobs for it in items]
        logit_indices, last_rows, offset, row = None, [], 0, 0
        if any(wants):
            logit_indices = []
            for it, w in zip(items, wants, strict=True):
                idx = range(offset, offset + it.extend_len) if w else [offset + it.extend_len - 1]
                logit_indices += idx
                row += len(idx)
                last_rows.append(row - 1)
                offset += it.extend_len
        logits = self.runner.forward_extend(
            reqs,
            input_ids,
            positions,
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[it.extend_len for it in items],
            logit_indices=logit_indices,
        )
        if logit_indices is not None:
            self._input_logprobs(items, wants, logits, last_rows)
            logits = logits[torch.tensor(last_rows, device=logits.device)]
        for it in items:
            it.req.kv_len += it.extend_len
            if it.decode:
                continue
            self.stats.num_prompt_tokens += it.extend_len
            # Insert what was computed (a chunk, or the whole prompt) so that requests sharing
            # it can match it before this one finishes.
            self._cache_unfinished(it.req)
        done = [i for i, it in enumerate(items) if it.completes]
        if not done:
            return []
        done_reqs = [reqs[i] for i in done]
        sampled = _InflightStep.start(done_reqs, self._sample_device(logits[done], done_reqs))
        new = [reqs[i] for i in done if not items[i].decode]
        if defer:
            self.running += [r for r in new if not r.is_finished]  # (failed while sampling)
            self._inflight_prefill = sampled
            return []
        outputs = self._resolve_prefill(sampled)
        self.running += [r for r in new if not r.is_finished]
        return outputs

    def _resolve_prefill(self, sampled: _InflightStep) -> list[ReqOutput]:
        """Wait for a prefill step's first tokens and apply them (requests aborted meanwhile
        are skipped)."""
        tokens, lps = sampled.host_results(self.stats)
        outputs = self._append_all(zip(sampled.reqs, tokens, lps, strict=True))
        self.running = [r for r in self.running if not r.is_finished]
        return outputs

    # ---- decode ---------------------------------------------------------------------------

    def _launch_decode(self, chained: bool) -> _InflightStep:
        """Launch one decode step over ``running`` (room ensured). ``chained``: the previous
        step is still in flight and its sampled tokens, still on the device, are the inputs."""
        logits, reqs = self._forward_decode(chained)
        return self._start_sampling(logits, reqs, pending=1 if chained else 0)

    def _start_sampling(self, logits: torch.Tensor, reqs: list[Req], pending: int):
        t = time.perf_counter()
        begin, self._decode_begin = self._decode_begin, None
        inflight = _InflightStep.start(
            reqs,
            self._sample_device(logits, reqs, pending),
            begin,
            chained=self._inflight is not None,
        )
        self.stats.time_sampling_launch_s += time.perf_counter() - t
        return inflight

    def _forward_decode(self, chained: bool) -> tuple[torch.Tensor, list[Req]]:
        t = time.perf_counter()
        self.stats.num_decode_batches += 1
        self.stats.num_decode_tokens += len(self.running)
        reqs = list(self.running)
        if self._time_device:
            self._decode_begin = torch.cuda.Event(enable_timing=True)
            self._decode_begin.record()
        locs = []
        for req in reqs:
            loc = self._alloc_kv(req, 1, write=False)
            assert loc is not None, "decode room was ensured"
            locs += loc
        positions = [req.kv_len for req in reqs]
        if chained:
            inflight = self._inflight
            id_rows = None
            if len(reqs) != len(inflight.reqs):  # some finished since: their rows drop out
                at = {id(r): i for i, r in enumerate(inflight.reqs)}
                id_rows = [at[id(r)] for r in reqs]
            logits = self.runner.forward_decode(
                reqs, None, positions, locs, input_ids_dev=inflight.tokens, id_rows=id_rows
            )
        else:
            input_ids = [req.output_ids[-1] for req in reqs]
            logits = self.runner.forward_decode(reqs, input_ids, positions, locs)
        for req in reqs:
            req.kv_len += 1
        self.stats.time_forward_launch_s += time.perf_counter() - t
        return logits, reqs

    def _resolve(self, inflight: _InflightStep) -> list[ReqOutput]:
        """Wait for a launched decode step's tokens and apply them."""
        t, waited = time.perf_counter(), self.stats.time_device_wait_s
        tokens, lps = inflight.host_results(self.stats)
        if inflight.begin is not None:
            self._time_on_device(inflight)
        outputs = self._append_all(zip(inflight.reqs, tokens, lps, strict=True))
        self.running = [r for r in self.running if not r.is_finished]
        self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - 0.001)
        dt = time.perf_counter() - t - (self.stats.time_device_wait_s - waited)
        self.stats.time_resolve_s += dt
        return outputs

    def _time_on_device(self, inflight: _InflightStep) -> None:
        """The device's busy time for a resolved decode step and, if it was chained, the idle
        time before it (both events completed: the step's last one was waited for)."""
        self.stats.time_device_decode_s += inflight.begin.elapsed_time(inflight.event) / 1e3
        prev = self._last_decode_end
        if inflight.chained and prev is not None:
            gap = max(prev.elapsed_time(inflight.begin) / 1e3, 0.0)
            st = self.stats
            st.time_device_idle_chained_s += gap
            st.num_device_idle_chained_steps += gap > 5e-4
            st.time_device_idle_chained_max_s = max(st.time_device_idle_chained_max_s, gap)
        self._last_decode_end = inflight.event

    def _can_chain(self) -> bool:
        """Whether the next step can be launched before the in-flight one is resolved: nothing
        but a decode of the in-flight batch's requests would run (those that finished since
        drop out: their rows of the in-flight tokens are skipped on the device), and the chained
        step stays inside the context. A request that finishes on the in-flight token (by
        length, a stop or its grammar) runs one step past it, as with stops: that token is
        discarded when it resolves, and its KV slot, released with the request, is reused only
        by steps queued after the one writing it."""
        inflight = self._inflight
        if self._aborts or self.chunked_req is not None or not self.running:
            return False
        # (running only shrinks between steps, keeping its order: new requests come by prefill)
        members = {id(r) for r in inflight.reqs}
        if any(id(r) not in members for r in self.running):
            return False
        for req in self.running:
            if req.seq_len + 2 >= self.context_len:
                return False
        # Finished requests' pages sit in the prefix cache: evict unused ones for the room
        # rather than break the chain (the pages may still be read by the step in flight, but
        # whatever reuses them is queued after it on the same stream). Only a retraction needs
        # the unchained path.
        if not self._free_by_evicting(self._decode_pages_needed()):
            return False
        return not self.waiting or self._nothing_admissible()  # (the costliest check last)

    def _nothing_admissible(self) -> bool:
        """Whether ``_schedule_extend`` would admit no waiting request now: the running limit or
        the request table is full, or the request it would try first does not fit (it stops at
        the first that does not). A decode step may then chain on the one in flight even though
        requests wait: resolving it first would admit nothing and only expose the host's work.
        Requests finishing in the step in flight still hold their pages here, so an admission
        they make room for waits one step."""
        if len(self.running) >= self.max_running or self.req_to_token_pool.num_free == 0:
            return True
        room = self._admission_room()
        ps = self.page_size
        if self.policy.deterministic and not hasattr(self.tree, "match_and_load"):
            head = self.policy.order(list(self.waiting), self._prefix_view)[0]
            matched = self.match(head)[0] if self.tree is not None else 0
            if self._pages_to_admit(head, matched) <= room:
                return False
            shared = matched // ps
            cand = (head.seq_len, self._growth_left(head), shared)
            return not self._fits_at_peak(self._peak_rows(self.running), [], cand, shared)
        # Otherwise a lower bound over the whole queue, whatever the prefix cache (or its host
        # tier) holds: each request's prompt matched up to its last token.
        if any(self._pages_to_admit(r, r.seq_len - 1) <= room for r in self.waiting):
            return False
        # and, for the peak bound, a candidate no larger than any waiting one
        own = min((r.seq_len - 1) % ps + 1 for r in self.waiting)
        growth = min(self._growth_left(r) for r in self.waiting)
        return not self._fits_at_peak(self._peak_rows(self.running), [], (own, growth, 0), 0)

    def _host_before_sampling(self) -> bool:
        return any(
            r.grammar is not None or r.sampling_params.custom_logit_processor for r in self.running
        )

    def _decode_pages_needed(self) -> int:
        """New pages the running requests' next tokens take (those at a page boundary)."""
        return sum(1 for r in self.running if r.kv_len % self.page_size == 0)

    def _free_by_evicting(self, need: int) -> bool:
        """Whether ``need`` pages are free, after evicting cached prefixes nobody is using if
        they were not."""
        short = need - self.allocator.num_free
        if short > 0 and self._evictable_pages() > 0:
            self.tree.evict(short * self.page_size)
        return need <= self.allocator.num_free

    def _ensure_decode_room(self) -> list[ReqOutput]:
        outputs = []
        # First evict cached prefixes nobody is using; retract only if that is not enough.
        while self.running and not self._free_by_evicting(self._decode_pages_needed()):
            if len(self.running) == 1:
                req = self.running.pop()
                logger.error("KV pool too small for request %s", req.rid)
                message = "the KV cache is too small for this request (raise --max-total-tokens)"
                req.error = message
                outputs.append(self._finish_abort(req, message))
                outputs[-1].finished_reason["status_code"] = 400
                break
            # Retract the request that has done the least work (fewest outputs, longest prompt).
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            self.running.remove(victim)
            self._release(victim, cache=True)  # its KV stays reusable until evicted
            victim.num_retractions += 1
            self.stats.num_retractions += 1
            self.waiting.appendleft(victim)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
            logger.info("retracted %s to free KV pages", victim.rid)
        return outputs

    # ---- sampling and finishing -----------------------------------------------------------

    def _sample_device(self, logits: torch.Tensor, reqs: list[Req], pending: int = 0) -> _Sampled:
        """Sampled ids on the device (no host sync); ``pending`` tokens per request are
        sampled but not yet appended (overlap), which shifts output positions. Order: custom
        processors, penalties, min_new_tokens, logit_bias, the grammar mask, then temperature
        and top-k/top-p/min-p. Logprobs are of the raw logits (before any of these)."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        params = [r.sampling_params for r in reqs]
        out_lens = [len(r.output_ids) + pending for r in reqs]
        plan = self._sampling_plan(logits, reqs, params, out_lens)
        info = plan.info
        want_lp = plan.want_logprobs
        raw = logits.clone() if want_lp else None
        if info.processors:
            histories = [TokenHistory.of(r.origin_input_ids, r.output_ids) for r in reqs]
            logits = apply_logits_processors(
                logits, info, params, histories, lambda row, e: self._fail_in_step(reqs[row], e)
            )
        if plan.masked_argmax:
            tokens = masked_argmax(logits, self._grammar_masks(logits, reqs))
            return self._finish_sampled(tokens, raw, reqs, want_lp)
        if plan.fused is not None:
            # Fused kernels: penalties, bias, the grammar's mask (its -inf entries stay -inf
            # under all of them), the draw, and the counts of the drawn tokens.
            mask = self._grammar_masks(logits, reqs) if plan.has_grammar else None
            if self._sampling_graphs:
                tokens = self._graph_sample(plan, logits, mask)
            else:
                tokens = self._fused_sample(plan, logits, mask)
            return self._finish_sampled(tokens, raw, reqs, want_lp)
        if plan.penalties is not None:
            batch_rows, state_rows, coef, row_base, ones, all_rows = plan.penalties
            apply_penalties(logits, batch_rows, state_rows, self.penalties, *coef.unbind(0))
        if plan.bias is not None:
            flat, v = plan.bias
            logits.view(-1).index_add_(0, flat, v)  # atomic adds: no sort, no sync
        if plan.has_grammar:
            self._apply_grammar_masks(logits, reqs)
        tokens = sample(logits, info)
        if plan.penalties is not None:
            picked = tokens if all_rows else tokens.index_select(0, batch_rows)
            self.penalties.add(state_rows, picked, row_base, ones)
        return self._finish_sampled(tokens, raw, reqs, want_lp)

    def _fused_sample(self, plan, logits, mask, row_seeds=None, params=None) -> torch.Tensor:
        info = plan.info
        return fused_sample(
            logits,
            info.params if params is None else params,
            None if row_seeds is not None else info.seeds,
            extras=plan.fused,
            state=self.penalties,
            vocab_mask=mask,
            greedy_only=info.is_all_greedy,
            search=info.need_top_k or info.need_top_p,
            row_seeds=row_seeds,
        )

    def _graph_sample(self, plan, logits, mask) -> torch.Tensor:
        """The fused kernels through the plan's CUDA graph: eager on the plan's first two
        steps, captured on its third, replayed from then on (see ``SamplingGraph``)."""
        g = plan.graph
        if g is None or not g.valid_for(logits, mask, self.penalties):
            plan.uses += 1
            if plan.row_seeds is None:
                seeds = per_row_seeds(logits.shape[0], plan.info.seeds)
                plan.row_seeds = torch.tensor(seeds, dtype=torch.int64).to(logits.device)
            shared = self._shared_graph_key(plan, logits, mask)
            g = self._shared_graphs.get(shared) if shared is not None else None
            if g is not None and g.valid_for(logits, mask, self.penalties):
                self._shared_graphs.move_to_end(shared)
                g.adopt(plan.info.params, plan.row_seeds)
                plan.row_seeds, plan.graph = g.seeds, g
                self.stats.num_sampling_graph_adoptions += 1
                return g(logits, mask)
            if plan.uses < 3:
                # eagerly, with the per-row seeds the graph will read: the same kernel
                # variants compile here, never inside the capture
                tokens = self._fused_sample(plan, logits, mask, row_seeds=plan.row_seeds)
                plan.row_seeds.add_(1)
                return tokens
            t = time.perf_counter()
            try:
                # a shared graph reads its own copy of the parameters and no penalty state: any
                # batch of its kind can adopt it
                g = SamplingGraph(
                    logits,
                    plan.row_seeds,
                    lambda lg, rs, m, pr: self._fused_sample(plan, lg, m, row_seeds=rs, params=pr),
                    vocab_mask=mask,
                    state=None if shared is not None else self.penalties,
                    params=plan.info.params if shared is not None else None,
                )
                if shared is not None:
                    self._shared_graphs[shared] = g
                    # each holds a static copy of its batch's logits: keep their sum bounded
                    while len(self._shared_graphs) > 1 and (
                        sum(x.logits.nbytes for x in self._shared_graphs.values())
                        > _SHARED_GRAPH_BYTES
                    ):
                        self._shared_graphs.popitem(last=False)
                plan.graph = g
            except Exception:  # noqa: BLE001 - any capture failure: sample eagerly from now on
                logger.exception("capturing the sampling kernels failed; sampling eagerly")
                self._sampling_graphs = False
                return self._fused_sample(plan, logits, mask)
            finally:
                self.stats.num_sampling_graph_captures += 1
                self.stats.time_sampling_graph_capture_s += time.perf_counter() - t
        return g(logits, mask)

    @staticmethod
    def _shared_graph_key(plan, logits, mask) -> tuple | None:
        """The key under which a batch's sampling graph can serve later batches: for batches
        whose fused kernels read no penalty rows and no bias (those are bound per batch), the
        logits' shape and the kernel variant."""
        f = plan.fused
        if f.state_rows is not None or f.bias_ptr is not None:
            return None
        info = plan.info
        search = info.need_top_k or info.need_top_p
        return (tuple(logits.shape), logits.dtype, mask is None, info.is_all_greedy, search)

    @staticmethod
    def _finish_sampled(tokens, raw, reqs, want_lp) -> _Sampled:
        out = _Sampled(tokens)
        if want_lp:
            lsm = torch.log_softmax(raw.float(), dim=-1)
            out.logprobs = lsm.gather(1, tokens.unsqueeze(1)).squeeze(1)
            k = max(r.top_logprobs_num for r in reqs)
            if k > 0:
                out.top_values, out.top_ids = lsm.topk(k, dim=-1)
        return out

    def _sampling_plan(self, logits, reqs, params, out_lens) -> _SamplingPlan:
        """The batch's sampling tensors (per-row parameters, penalty rows and coefficients,
        logit-bias and min_new_tokens entries), built once and reused while the batch stays the
        same: in steady decode a step then does no per-request Python and no host-to-device
        copy for sampling. Only seeded rows' output positions change from step to step."""
        key = (
            logits.shape[-1],
            logits.device,
            tuple(
                (r.rid, r.is_finished, n < p.min_new_tokens)
                for r, p, n in zip(reqs, params, out_lens, strict=True)
            ),
        )
        plan = self._plan_cache
        if plan is None or plan.key != key:
            plan = self._plan_cache = self._build_sampling_plan(key, logits, reqs, params, out_lens)
        if plan.seeded:
            plan.info.seeds = [(i, params[i].sampling_seed, out_lens[i]) for i in plan.seeded]
        return plan

    def _build_sampling_plan(self, key, logits, reqs, params, out_lens) -> _SamplingPlan:
        dev = logits.device
        vocab = logits.shape[-1]
        pen = [i for i, p in enumerate(params) if p.has_penalties and not reqs[i].is_finished]
        bias_rows = [
            i for i, (p, n) in enumerate(zip(params, out_lens, strict=True))
            if n < p.min_new_tokens or p.logit_bias
        ]  # fmt: skip
        has_grammar = any(r.grammar is not None and not r.is_finished for r in reqs)
        # On a GPU the fused kernels also apply a grammar's bitmask (no library launch);
        # LOOM_GRAMMAR_MASK=library keeps the library's kernel for batches without penalties or
        # bias (to compare the two: bench/h200_more.sh structuredab).
        grammar_fused = has_grammar and _GRAMMAR_MASK != "library"
        fused = (pen or bias_rows or grammar_fused) and fused_sampling_enabled(logits)
        greedy = all(p.is_greedy for p in params)
        masked = fused and not (pen or bias_rows) and greedy and _GRAMMAR_MASK == "auto"
        fused = fused and not masked
        info = SamplingBatchInfo.build(params, out_lens, vocab, dev, with_params=fused)
        plan = _SamplingPlan(
            key=key,
            info=info,
            seeded=[i for i, p in enumerate(params) if p.sampling_seed is not None],
            want_logprobs=any(r.return_logprob for r in reqs),
            has_grammar=has_grammar,
            masked_argmax=masked,
        )
        if pen:
            if self.penalties is None:
                self.penalties = PenaltyState(logits.shape[-1], dev)
            for i in pen:
                if reqs[i].penalty_row is None:
                    reqs[i].penalty_row = self.penalties.alloc(reqs[i].origin_input_ids)
        if fused:
            plan.fused = self._fused_penalties(reqs, params, out_lens, pen, bias_rows, dev)
            return plan
        if pen:
            coef = torch.tensor(
                [
                    [float(params[i].frequency_penalty) for i in pen],
                    [float(params[i].presence_penalty) for i in pen],
                    [float(params[i].repetition_penalty) for i in pen],
                ],
                dtype=logits.dtype,
            ).to(dev, non_blocking=True)
            idx = torch.tensor([pen, [reqs[i].penalty_row for i in pen]], dtype=torch.int64).to(
                dev, non_blocking=True
            )
            # (batch rows, state rows, coefficients, state rows x vocab, ones, every row?)
            plan.penalties = (
                idx[0],
                idx[1],
                coef,
                idx[1] * logits.shape[-1],
                torch.ones(len(pen), dtype=torch.int32, device=dev),
                len(pen) == len(params),
            )
        biases = self._row_biases(params, out_lens, bias_rows)
        if biases:
            flat = torch.tensor([i * vocab + t for i, row in biases.items() for t in row])
            vals = [b for row in biases.values() for b in row.values()]
            v = torch.tensor(vals, dtype=logits.dtype).to(dev, non_blocking=True)
            plan.bias = (flat.to(dev, non_blocking=True), v)
        return plan

    def _row_biases(self, params, out_lens, rows) -> dict[int, dict[int, float]]:
        """Batch row -> token -> what is added to its logit: ``logit_bias``, and -inf for EOS
        and ``stop_token_ids`` while fewer than ``min_new_tokens`` have been generated."""
        out = {}
        for i in rows:
            p, row = params[i], {}
            for t, b in (p.logit_bias or {}).items():
                row[int(t)] = float(b)
            if out_lens[i] < p.min_new_tokens:
                for t in self.eos_token_ids | set(p.stop_token_ids):
                    row[t] = float("-inf")
            out[i] = row
        return out

    def _fused_penalties(self, reqs, params, out_lens, pen, bias_rows, dev) -> FusedPenalties:
        """The plan's penalty rows and coefficients and its logit bias (with min_new_tokens'
        -inf entries) as the fused sampling kernel takes them."""
        bs = len(params)
        state_rows = coef = bias = None
        if pen:
            state_rows = [-1] * bs
            coef = [[0.0] * bs, [0.0] * bs, [1.0] * bs]
            for i in pen:
                p = params[i]
                state_rows[i] = reqs[i].penalty_row
                coef[0][i] = float(p.frequency_penalty)
                coef[1][i] = float(p.presence_penalty)
                coef[2][i] = float(p.repetition_penalty)
        if bias_rows:
            biases = self._row_biases(params, out_lens, bias_rows)
            bias = [biases.get(i, {}) for i in range(bs)]
        return FusedPenalties.build(state_rows, coef, bias, dev)

    def _apply_grammar_masks(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """Each constrained row's allowed tokens, applied in place with the library's kernel
        (the fused sampling kernels apply the mask themselves)."""
        self.grammar_mgr.backend.apply_vocab_mask(logits, self._grammar_masks(logits, reqs))

    def _grammar_masks(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """The step's grammar bitmask on ``logits``' device, filled on the host (on a GPU this
        overlaps the forward pass just launched) and copied without a sync."""
        t = time.perf_counter()
        backend = self.grammar_mgr.backend
        mask = self._host_vocab_mask(backend, len(reqs), logits.device)
        # (a request that finished while this step's forward ran keeps an unmasked row; its
        # token is discarded)
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None and not req.is_finished]
        try:
            backend.fill_vocab_masks([reqs[i].grammar for i in rows], mask, rows)
        except Exception:  # noqa: BLE001 - find the matcher that failed; fail its request alone
            for i in rows:
                try:
                    reqs[i].grammar.fill_vocab_mask(mask, i)
                except Exception as e:  # noqa: BLE001
                    self._fail_in_step(reqs[i], e)
        mask = mask.to(logits.device, non_blocking=True)
        self.stats.time_grammar_mask_s += time.perf_counter() - t
        return mask

    def _host_vocab_mask(self, backend, bs: int, device: torch.device) -> torch.Tensor:
        """The host bitmask for this step. On CUDA: alternate halves of two pinned buffers, so
        the copy to the device is asynchronous and a buffer is refilled only after the step
        that copied it was resolved (two steps later)."""
        if device.type != "cuda":
            return backend.allocate_vocab_mask(bs)
        bufs = self._mask_bufs
        if bufs is None or bufs[0].shape[0] < bs:
            proto = backend.allocate_vocab_mask(1)
            cap = max(bs, self.max_running)
            bufs = self._mask_bufs = [
                torch.empty((cap, proto.shape[1]), dtype=proto.dtype, pin_memory=True)
                for _ in range(2)
            ]
        self._mask_flip ^= 1
        mask = bufs[self._mask_flip][:bs]
        backend.reset_vocab_mask(mask)
        return mask

    def _append_all(self, rows) -> list[ReqOutput]:
        """``_append_token`` over a step's (req, token, logprob) rows, skipping requests that
        finished meanwhile (overlap ran one step past them); a request whose append raised (its
        grammar matcher, say) fails alone and the rest go on. (One ``try`` around the loop,
        resumed on the same iterator: nothing per row on the way that does not fail.)"""
        outputs: list[ReqOutput] = []
        rows = iter(rows)
        req = None
        while True:
            try:
                for req, tok, lp in rows:
                    if not req.is_finished:
                        outputs.append(self._append_token(req, tok, lp))
                return outputs
            except Exception as e:  # noqa: BLE001 - isolated to this request
                self._fail_in_step(req, e)

    def _append_token(self, req: Req, token: int, logprob=None) -> ReqOutput:
        req.output_ids.append(token)
        if logprob is not None and req.return_logprob:
            lp, top = logprob
            req.pending_logprobs.append((lp, token))
            req.pending_top_logprobs.append(top[: req.top_logprobs_num])
        self.stats.num_generated_tokens += 1
        p = req.sampling_params
        if req.grammar is not None:
            if not req.grammar.accept_token(token):
                req.error = f"the grammar rejected token {token}"
                req.finished_reason = {"type": "abort", "message": req.error}
            elif req.grammar.is_terminated():
                req.finished_reason = {"type": "stop", "matched": token}
        if req.is_finished:  # by the grammar
            pass
        elif token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            req.finished_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finished_reason = {"type": "length", "length": p.max_new_tokens}
        elif req.seq_len >= self.context_len:
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}
        if req.is_finished:
            self._release(req, cache=True)
            self._release_penalty(req)
        return self._output(req, [token])

    def _release_penalty(self, req: Req) -> None:
        if req.penalty_row is not None:
            self.penalties.release(req.penalty_row)
            req.penalty_row = None

    def _output(self, req: Req, tokens: list[int]) -> ReqOutput:
        extra = {}
        if req.return_logprob:
            extra["output_token_logprobs"], req.pending_logprobs = req.pending_logprobs, []
            if req.top_logprobs_num:
                extra["output_top_logprobs"], req.pending_top_logprobs = (
                    req.pending_top_logprobs,
                    [],
                )
            if req.pending_input_logprobs is not None:
                extra["input_token_logprobs"] = req.pending_input_logprobs
                req.pending_input_logprobs = None
        return ReqOutput(
            extra=extra,
            rid=req.rid,
            new_token_ids=tokens,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finished_reason=req.finished_reason,
            error=req.error,
        )


def model_fingerprint(path: str) -> str:
    """What identifies a model's weights independently of where they are: the names and sizes
    of its weight files (a file model: its name and size), plus its config's text."""
    import hashlib
    import os

    h = hashlib.sha256()
    if os.path.isfile(path):
        h.update(f"{os.path.basename(path)}:{os.path.getsize(path)}".encode())
        if path.endswith(".json"):  # a config for --load-format dummy
            with open(path, "rb") as f:
                h.update(f.read())
        return h.hexdigest()
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            h.update(f"{entry}:{os.path.getsize(full)}".encode())
        elif entry == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()
