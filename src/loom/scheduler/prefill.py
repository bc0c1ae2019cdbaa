"""Admission and prefill: which waiting requests start, how much of each prompt a step
computes, and the prefill forward with its prompt logprobs.

Waiting requests are admitted in the schedule policy's order while they fit: a free request
row, the step's prefill token budget (``chunked_prefill_size``, SGLang's semantics: a burst of
prompts cannot stall running requests for long) and enough KV after reserving decode room for
everyone admitted (``DecodeManager.reserved_pages``), or, beyond that estimate, the peak bound of
``admission.py`` (no retraction can follow). A prompt longer than the chunk size is prefilled
over several steps, one chunked request at a time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom import plugins
from loom.config import device_defaults
from loom.forward_batch import int64_tensor
from loom.lora.slots import LoRASlots, LoRAUnavailable
from loom.sampling.batch_sampler import BatchSampler
from loom.scheduler.admission import peak_pages
from loom.scheduler.cache import CacheManager
from loom.scheduler.decode import DecodeManager, InflightStep, Rows
from loom.scheduler.messages import ReqOutput
from loom.scheduler.request import Req
from loom.scheduler.stats import SchedulerStats


@dataclass
class ExtendItem:
    req: Req
    prefix_len: int
    extend_len: int
    decode: bool = False  # a running request's next token, mixed into a prefill batch

    @property
    def completes(self) -> bool:
        """Whether the step samples this request's next token: a decoding row always (chained
        on a step in flight, its last token is not appended yet), a prompt with its last
        chunk."""
        return self.decode or self.prefix_len + self.extend_len == self.req.seq_len


class PrefillManager:
    """``args``: the scheduler section of the server arguments (``SchedulerArgs``); ``seed``:
    the schedule policy's. ``on_error(req, exc or message)`` fails one request whose admission raised;
    ``apply(rows)`` applies a step's (request, token, logprob) rows and returns the outputs."""

    def __init__(
        self,
        args,
        page_size: int,
        seed: int,
        runner,
        decode: DecodeManager,
        lora: LoRASlots,
        on_error: Callable[[Req, BaseException | str], None],
        cache: CacheManager,
        sampler: BatchSampler,
        stats: SchedulerStats,
        apply: Callable[[Rows], list[ReqOutput]],
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.decode = decode
        self.sampler = sampler
        self.lora = lora
        self.stats = stats
        self.on_error = on_error
        self.apply = apply
        self.max_running = runner.max_running_requests
        self.page_size = page_size
        chunk = args.chunked_prefill_size
        if chunk is None:
            chunk = device_defaults(runner.device.type).chunked_prefill_size
        self.chunk_size = math.inf if chunk == -1 else max(chunk, self.page_size)
        self.max_prefill_tokens = args.max_prefill_tokens
        self.enable_mixed_chunk = args.enable_mixed_chunk
        policy_cls = plugins.resolve("schedule_policy", args.schedule_policy)
        self.policy = policy_cls(seed=seed)
        self.waiting: deque[Req] = deque()
        self.chunked_req: Req | None = None
        # Overlap: a prefill step whose sampled first tokens are still on their way; the next
        # prefill launches before they are applied (its requests already count as running)
        self.inflight: InflightStep | None = None
        # CUDA: events around prefill steps the device may not have finished yet
        self._time_device = runner.device.type == "cuda"
        self._device_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def reset(self, keep_waiting: bool) -> None:
        """Forget the chunked request and the step in flight (a failed step), and the queue
        unless ``keep_waiting``."""
        self.chunked_req, self.inflight = None, None
        self._device_spans.clear()
        if not keep_waiting:
            self.waiting = deque()

    def remove(self, req: Req) -> None:
        self.waiting = deque(r for r in self.waiting if r is not req)
        if self.chunked_req is req:
            self.chunked_req = None

    # ---- admission ------------------------------------------------------------------------

    def room(self) -> int:
        """Pages a new request may take: free and evictable ones, less those kept for requests
        already admitted."""
        reserved = self.decode.reserved_pages(self.chunked_req)
        return self.cache.num_free + self.cache.evictable_pages() - reserved

    def _pages_to_admit(self, req: Req, matched_tokens: int) -> int:
        """Pages admitting ``req`` reserves: its tokens so far plus its expected output, less
        the ``matched_tokens`` of its prefix already in the cache."""
        remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
        ratio = self.decode.new_token_ratio
        need = self.cache.pages_for(req.seq_len + math.ceil(remaining * ratio))
        return need - matched_tokens // self.page_size

    @staticmethod
    def _growth_left(req: Req) -> int:
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
        room = self.cache.num_free + self.cache.evictable_pages() + owned + o2 - held
        peak = peak_pages(
            tokens + t2 + [cand[0]],
            growth + g2 + [cand[1]],
            shared + s2 + [cand[2]],
            self.page_size,
        )
        return peak <= room

    def schedule(self) -> list[ExtendItem]:
        """This step's prefill batch: the chunked request's next chunk, then the waiting
        requests admitted (their KV allocated, their matched prefix in use)."""
        items: list[ExtendItem] = []
        cache = self.cache
        budget = min(self.max_prefill_tokens, self.chunk_size)
        if self.chunked_req is not None:
            req = self.chunked_req
            n = int(min(req.seq_len - req.kv_len, self.chunk_size, budget))
            if cache.alloc_kv(req, n) is None:
                return []  # wait for running requests to free pages
            items.append(ExtendItem(req, req.kv_len, n))
            budget -= n
            if req.kv_len + n == req.seq_len:
                self.chunked_req = None
            else:
                return items
        if not self.waiting:
            return items
        running = self.decode.running
        ordered = self.policy.order(list(self.waiting), cache.prefix_view)
        free_pages = self.room()
        num_active = len(running) + len(items)
        admitted_prompts: set[int] = set()
        running_rows = None  # the running requests' rows for the peak bound, on first use
        lora_blocked = False
        for req in ordered:
            if budget <= 0 or num_active >= self.max_running or not cache.has_free_row():
                break
            try:
                if (
                    cache.tree is not None
                    and not req.output_ids
                    and len(req.origin_input_ids) > self.page_size
                ):
                    # n > 1 (or any identical prompts arriving together): prefill the prompt once;
                    # the others wait one step and match its KV in the radix cache.
                    if req.prompt_hash in admitted_prompts:
                        continue
                    admitted_prompts.add(req.prompt_hash)
                slots, node = cache.lookup(req)
                need = self._pages_to_admit(req, len(slots))
                # Alone, a request needs only its prompt plus one token of room: if it later
                # outgrows the pool it is aborted with a clear message rather than starved.
                alone = not running and not items
                room = cache.num_free + cache.evictable_pages()
                if need > free_pages and not (
                    alone and room >= cache.pages_for(req.seq_len + 1 - len(slots))
                ):
                    # Beyond the expected pages, admit what fits even if everything runs to its
                    # limit (no retraction can follow; admission.py)
                    if running_rows is None:
                        running_rows = self._peak_rows(running)
                    shared = len(slots) // self.page_size
                    cand = (req.seq_len, self._growth_left(req), shared)
                    if not self._fits_at_peak(running_rows, [it.req for it in items], cand, shared):
                        break
                if req.lora_id is not None:
                    if lora_blocked:
                        continue
                    state = self.lora.acquire(req)
                    if state == "loading":
                        continue  # its adapter is on its way; the others run meanwhile
                    if state == "busy":
                        # Every adapter slot is busy with other running adapters. Base-model
                        # requests may pass it, adapter requests may not: the adapters holding
                        # the slots then drain, and this one gets a slot (no adapter starves
                        # behind a busy one).
                        lora_blocked = True
                        continue
                cache.alloc_row(req)
                evictable_before = cache.evictable_pages()
                cache.use_prefix(req, slots, node)
                locked = evictable_before - cache.evictable_pages()
                n = int(min(req.seq_len - req.kv_len, self.chunk_size, budget))
                if cache.alloc_kv(req, n) is None:
                    cache.release(req)
                    self.lora.release(req)
                    break
                self.waiting.remove(req)
                free_pages -= need + locked
                budget -= n
                num_active += 1
                items.append(ExtendItem(req, req.kv_len, n))
                if req.kv_len + n < req.seq_len:
                    self.chunked_req = req
                    break
            except LoRAUnavailable as e:
                self.on_error(req, str(e))
            except Exception as e:  # noqa: BLE001 - this request's arithmetic or state
                self.on_error(req, e)
        return items

    def nothing_admissible(self) -> bool:
        """Whether ``schedule`` would admit no waiting request now: the running limit or the
        request table is full, or the request it would try first does not fit (it stops at the
        first that does not). A decode step may then chain on the one in flight even though
        requests wait: resolving it first would admit nothing and only expose the host's work.
        Requests finishing in the step in flight still hold their pages here, so an admission
        they make room for waits one step."""
        running, cache = self.decode.running, self.cache
        if len(running) >= self.max_running or not cache.has_free_row():
            return True
        room = self.room()
        ps = self.page_size
        if self.policy.deterministic and not cache.loads_on_match:
            head = self.policy.order(list(self.waiting), cache.prefix_view)[0]
            matched = cache.match(head)[0] if cache.tree is not None else 0
            if self._pages_to_admit(head, matched) <= room:
                return False
            shared = matched // ps
            cand = (head.seq_len, self._growth_left(head), shared)
            return not self._fits_at_peak(self._peak_rows(running), [], cand, shared)
        # Otherwise a lower bound over the whole queue, whatever the prefix cache (or its host
        # tier) holds: each request's prompt matched up to its last token.
        if any(self._pages_to_admit(r, r.seq_len - 1) <= room for r in self.waiting):
            return False
        # and, for the peak bound, a candidate no larger than any waiting one
        own = min((r.seq_len - 1) % ps + 1 for r in self.waiting)
        growth = min(self._growth_left(r) for r in self.waiting)
        return not self._fits_at_peak(self._peak_rows(running), [], (own, growth, 0), 0)

    def mixed_decode_items(self) -> list[ExtendItem]:
        """``--enable-mixed-chunk``: the running requests decode one token inside the prefill
        batch (an extend of one token over their cached KV) instead of waiting for it, which
        keeps inter-token latency flat while long prompts prefill. Skipped when the pool could
        not give every running request its next slot without evicting or retracting."""
        if self.decode.pages_needed() > self.cache.num_free:
            return []
        running = self.decode.running
        slots = self.cache.alloc_next_slots(running)
        if slots is None:  # cannot happen: room was checked
            raise AssertionError("mixed decode slot")
        items = [ExtendItem(req, req.kv_len, 1, decode=True) for req in running]
        self.cache.write_slots(  # one copy for the running requests
            [r.req_pool_idx for r in running], [r.kv_len for r in running], slots
        )
        self.stats.num_mixed_batches += 1
        return items

    def may_defer(self, items: list[ExtendItem]) -> bool:
        """Whether a prefill step's first tokens may be applied a step later (overlap): not when
        it computes prompt logprobs. (With ``--enable-mixed-chunk`` such a step goes in flight
        as a decode step instead, ``launch``.)"""
        return not any(it.req.wants_input_logprobs for it in items)

    # ---- the prefill step -----------------------------------------------------------------

    def run(self, items: list[ExtendItem], defer: bool = False) -> list[ReqOutput]:
        """One prefill step. ``defer``: launch it and leave its sampled first tokens in flight
        (``inflight``, applied by the next step); its requests join the running batch now, so
        that admission counts them."""
        sampled, new = self._forward(items)
        if sampled is None:
            return []
        if defer:
            self.decode.running += [r for r in new if not r.is_finished]  # (failed sampling)
            self.inflight = sampled
            return []
        outputs = self.resolve(sampled)
        self.decode.running += [r for r in new if not r.is_finished]
        return outputs

    def resolve(self, sampled: InflightStep) -> list[ReqOutput]:
        """Wait for a prefill step's first tokens and apply them (requests aborted meanwhile
        are skipped)."""
        tokens, lps = sampled.host_results(self.stats)
        outputs = self.apply(zip(sampled.reqs, tokens, lps, strict=True))
        self.decode.drop_finished()
        return outputs

    def launch(
        self, items: list[ExtendItem], chained_on: InflightStep | None = None
    ) -> InflightStep | None:
        """Overlap for mixed steps: launch this step and return it in flight (the scheduler
        resolves it a step later, as a decode step, and may chain the next step on its
        samples); its requests that start decoding join the running batch now. ``chained_on``:
        the decode step still running, whose samples on the device are the decoding rows'
        ids."""
        sampled, new = self._forward(items, chained_on=chained_on)
        self.decode.running += [r for r in new if not r.is_finished]
        if chained_on is not None:
            self.stats.num_chained_mixed_batches += 1
        return sampled

    def _forward(
        self, items: list[ExtendItem], chained_on: InflightStep | None = None
    ) -> tuple[InflightStep | None, list[Req]]:
        """The prefill forward: its sampled first tokens (of the requests whose prompt it
        completes) on their way to the host, and the requests that start decoding.
        ``chained_on``: the decode step in flight whose samples are the decoding rows' ids
        (``launch_chained``)."""
        self.stats.num_prefill_batches += 1
        input_ids, positions = [], []
        for it in items:
            if it.decode:  # (its one token is its last output, or in flight)
                input_ids.append(it.req.output_ids[-1] if chained_on is None else 0)
                positions.append(it.prefix_len)
                continue
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
        ids_from = None
        if chained_on is not None:
            at = {id(r): i for i, r in enumerate(chained_on.reqs)}
            rows = [at[id(it.req)] for it in items if it.decode]
            # (mixed_decode_items appends the decoding rows after the prompts)
            assert all(it.decode for it in items[len(items) - len(rows) :])
            ids_from = (chained_on.tokens, rows) if rows else None
        begin = None
        if self._time_device:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        logits = self.runner.forward_extend(
            input_ids,
            positions,
            [r.req_pool_idx for r in reqs],
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[it.extend_len for it in items],
            lora_slots=[r.lora_slot for r in reqs],
            logit_indices=logit_indices,
            ids_from=ids_from,
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
            self.cache.cache_unfinished(it.req)
        # Sampled rows in the running batch's order: the decoding rows (running's order), then
        # the requests that start decoding (appended to running in this order), so that a
        # decode step chained on this one finds its ids row for row.
        done = [i for i, it in enumerate(items) if it.decode]
        done += [i for i, it in enumerate(items) if not it.decode and it.completes]
        if not done:
            self._end_device_span(begin)
            return None, []
        done_reqs = [reqs[i] for i in done]
        # chained: a decoding row's token in flight is sampled but not yet appended
        pending = [int(chained_on is not None and items[i].decode) for i in done]
        if done != list(range(len(logits))):
            # an index tensor copied without blocking: ``logits[done]`` with a list waits for
            # the device, which kept a chained mixed step from overlapping the next one's launch
            at = int64_tensor(done).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, at)
        sampled = InflightStep.start(done_reqs, self.sampler.sample(logits, done_reqs, pending))
        self._end_device_span(begin)
        return sampled, [reqs[i] for i in done if not items[i].decode]

    def _end_device_span(self, begin: torch.cuda.Event | None) -> None:
        """CUDA: close the device span of the prefill step just queued, and add up those the
        device has finished (``time_device_prefill_s``) without waiting for any."""
        if begin is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        spans = self._device_spans
        spans.append((begin, end))
        while spans and spans[0][1].query():
            b, e = spans.popleft()
            self.stats.time_device_prefill_s += b.elapsed_time(e) / 1e3

    @staticmethod
    def _input_logprobs(items, wants, logits, last_rows) -> None:
        """Logprobs of prompt tokens from this chunk's logits: the logits at position q give
        the logprob of token q + 1 (token 0 has none), and with ``top_logprobs_num`` the top
        entries there (with ``token_ids_logprob``, those ids' entries)."""
        start_row = 0
        for it, w, last in zip(items, wants, last_rows, strict=True):
            rows_start = start_row
            start_row = last + 1
            if not w:
                continue
            req = it.req
            prompt = req.origin_input_ids
            s, e = it.prefix_len, it.prefix_len + it.extend_len
            acc, top_acc, k = req.input_logprob_acc, req.input_top_acc, req.top_logprobs_num
            chosen, ids_acc = req.token_ids_logprob, req.input_token_ids_acc
            if s == 0 and req.logprob_start_len == 0:
                acc.append((None, prompt[0]))
                top_acc.append(None)
                ids_acc.append(None)
            qs = [q for q in range(s, min(e, len(prompt) - 1)) if q + 1 >= req.logprob_start_len]
            if qs:
                rows = torch.tensor([rows_start + q - s for q in qs], device=logits.device)
                toks = torch.tensor([prompt[q + 1] for q in qs], device=logits.device)
                lsm = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
                vals = lsm.gather(1, toks.unsqueeze(1)).squeeze(1).tolist()
                acc += [(v, prompt[q + 1]) for v, q in zip(vals, qs, strict=True)]
                if k:
                    top_v, top_i = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
                    top_acc += [
                        list(zip(v, i, strict=True))
                        for v, i in zip(top_v.tolist(), top_i.tolist(), strict=True)
                    ]
                if chosen:
                    ids = torch.tensor(chosen, device=logits.device)
                    ids_acc += [
                        list(zip(v, chosen, strict=True)) for v in lsm.index_select(1, ids).tolist()
                    ]
            if e >= len(prompt):
                req.pending_input_logprobs, req.input_logprob_acc = acc, []
                if k:
                    req.pending_input_top_logprobs, req.input_top_acc = top_acc, []
                if chosen:
                    req.pending_input_token_ids_logprobs, req.input_token_ids_acc = ids_acc, []
