"""The scheduler: continuous batching over the paged KV pool.

Each ``step()`` picks one batch, runs it and turns sampled tokens into ``ReqOutput``s: aborts
are applied and compiled grammars release their requests; then prefill (``prefill.py``: the
chunked request continues, waiting requests are admitted while they fit), or else one decode
step for every running request (``decode.py``: retraction when the pool is short; with overlap
on CUDA the next step launches before the last one's tokens reach the host).

The parts own their state: the cache manager the pages, rows and prefix tree (``cache.py``),
the batch sampler the sampling plan and penalty counts (``sampling/batch_sampler.py``), the
grammar queue the compiling requests (``constrained/queue.py``), the LoRA slots the adapters'
device slots (``lora/slots.py``). This module keeps intake, aborts, failures and the step.
Invariant (``check_kv_balance``): every page is free or held by one request or the tree.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from loom.constrained.queue import GrammarQueue, grammar_backend_factory
from loom.lora.slots import LoRASlots
from loom.sampling.batch_sampler import BatchSampler
from loom.scheduler.cache import CacheManager
from loom.scheduler.decode import DecodeManager, Rows
from loom.scheduler.messages import ReqOutput
from loom.scheduler.outputs import append_token, make_output
from loom.scheduler.prefill import PrefillManager
from loom.scheduler.request import Req
from loom.scheduler.stats import SchedulerStats, hist_add

if TYPE_CHECKING:
    from loom.config import ServerArgs
    from loom.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, server_args: ServerArgs, runner: ModelRunner, eos_token_ids: set[int]
    ) -> None:
        self.args = server_args
        self.runner = runner
        self.eos_token_ids = set(eos_token_ids)
        self.context_len = runner.model_config.context_len
        self.stats = SchedulerStats()
        self.cache = CacheManager.for_runner(server_args, runner)
        grammar = server_args.grammar_args
        self.grammar_queue = GrammarQueue(
            grammar_backend_factory(
                grammar, server_args.tokenizer_path, runner, self.eos_token_ids
            ),
            grammar.grammar_compile_timeout,
            grammar.structured_output_close_within_budget,
        )
        self.lora = LoRASlots(runner.lora_manager)
        self.sampler = BatchSampler(
            self.eos_token_ids,
            runner.max_running_requests,
            lambda: self.grammar_queue.backend,
            on_error=self._fail_in_step,
            stats=self.stats,
            close_within_budget=self.grammar_queue.close_within_budget,
        )
        parts = (self.cache, self.sampler, self.stats, self._append_all)
        self.decode = DecodeManager(runner, *parts, server_args.schedule_conservativeness)
        self.prefill = PrefillManager(
            server_args.scheduler_args,
            server_args.page_size,
            server_args.random_seed,
            runner,
            self.decode,
            self.lora,
            self._fail_in_step,
            *parts,
        )
        # Overlap scheduling: on CUDA the host prepares step N+1 while the device runs step N.
        self.overlap = runner.device.type == "cuda" and not server_args.disable_overlap_schedule
        self._aborts: set[str] = set()
        self._tail_s = self._prefill_tail_s = 0.0  # this step's waits for steps in flight
        # Failure isolation: every request the scheduler holds whose last output has not left
        # a step yet (a failed step fails these, so none is lost), the outputs of requests
        # failed inside a step, and the steps failed in a row.
        self._live: dict[str, Req] = {}
        self._failed: list[ReqOutput] = []
        self._failed_steps = 0

    def close(self) -> None:
        self.cache.close()
        self.grammar_queue.close()
        self.lora.close()
        self.runner.close()

    def reset_after_warmup(self) -> None:
        """Counters from zero and the admission estimate from its start (the warm-up's
        requests have all ended)."""
        self.check_kv_balance()
        self.sampler.reset()
        self.decode.reset_ratio()
        self.stats.reset()

    # ---- intake ---------------------------------------------------------------------------

    def add_request(self, req: Req) -> list[ReqOutput]:
        """Queue ``req``; its outputs if it ends at once (refused, or nothing to generate). An
        exception fails this request alone."""
        try:
            outputs = self._add_request(req)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            logger.exception("request %s failed on arrival", req.rid)
            self.prefill.remove(req)
            self.grammar_queue.remove(req)
            return [self._fail(req, f"internal error: {type(e).__name__}: {e}", 500)]
        if not outputs:
            self._live[req.rid] = req
        return outputs

    def _add_request(self, req: Req) -> list[ReqOutput]:
        error = self.lora.check(req)
        if error is not None:
            return [self._fail(req, error)]
        # Nothing to generate ends at once, unless the prompt's logprobs are asked for (scoring
        # a text, SGLang's `select`): then the prefill runs and the sampled token is dropped.
        if req.sampling_params.max_new_tokens == 0 and not req.wants_input_logprobs:
            req.finished_reason = {"type": "length", "length": 0}
            return [make_output(req, [])]
        if req.sampling_params.constraint is not None:
            try:
                self.grammar_queue.submit(req)
            except Exception as e:  # noqa: BLE001 - no tokenizer, bad backend options
                return [self._fail(req, f"structured output unavailable: {e}")]
            return []
        self.prefill.waiting.append(req)
        return []

    def _poll_grammars(self) -> list[ReqOutput]:
        """Move requests whose grammar compiled to the waiting queue; fail the others."""
        if not self.grammar_queue:
            return []
        ready, failed = self.grammar_queue.poll()
        self.prefill.waiting.extend(ready)
        return [self._fail(req, message) for req, message in failed]

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.prefill.waiting) or self._busy

    @property
    def waiting_on_loads(self) -> bool:
        """Nothing runs or is in flight while adapters are read from disk: what is queued waits
        for them, so the loop may sleep until a read ends or a message comes."""
        return self.lora.loading and not self._busy

    @property
    def _busy(self) -> bool:
        return bool(
            self.decode.running
            or self.prefill.chunked_req
            or self._aborts
            or self.decode.inflight is not None
            or self.prefill.inflight is not None
            or self.grammar_queue
        )

    def unload_lora(self, lora_id: str, name: str) -> str | None:
        """Unload an adapter no queued or running request uses; the error message, or None."""
        users = [r.rid for r in self._owners(self.grammar_queue) if r.lora_id == lora_id]
        return self.lora.unload(lora_id, name, users)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when idle (running requests may hold matched paths)."""
        if self.has_work:
            return self.cache.tree is None
        self.cache.flush()
        return True

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None, abort_all: bool
    ) -> tuple[str | None, list[ReqOutput], int]:
        """Swap the weights (``ModelRunner.update_weights_from_disk``) between steps: the steps
        in flight are resolved, then every request is aborted (``abort_all``) or the running
        ones (and a prompt being chunked) are retracted to the front of the queue, to go on from
        their tokens so far on the new weights; the prefix cache, computed by the old weights,
        is emptied. Returns the error (None: swapped; the old weights keep serving otherwise),
        the outputs this produced and how many requests were paused."""
        outputs = self._resolve_inflight()
        paused = 0
        if abort_all:
            self._aborts |= {r.rid for r in self.grammar_queue}
            for queue in (self.prefill.waiting, self.decode.running):
                self._aborts |= {r.rid for r in queue}
            if self.prefill.chunked_req is not None:
                self._aborts.add(self.prefill.chunked_req.rid)
            outputs += self._apply_aborts()
        else:
            chunked, self.prefill.chunked_req = self.prefill.chunked_req, None
            running = self.decode.running + ([chunked] if chunked is not None else [])
            self.decode.running = []
            for req in reversed(running):  # (appended to the front: they keep their order)
                self._retract(req)
            paused = len(running)
        self.cache.flush()
        try:
            self.runner.update_weights_from_disk(model_path, load_format)
        except (ValueError, OSError) as e:
            return str(e), outputs, paused
        return None, outputs, paused

    def _resolve_inflight(self) -> list[ReqOutput]:
        """Apply the steps still in flight (their tokens)."""
        outputs = []
        if self.decode.inflight is not None:
            outputs += self.decode.resolve(self.decode.inflight)
            self.decode.inflight = None
        if self.prefill.inflight is not None:
            pending, self.prefill.inflight = self.prefill.inflight, None
            outputs += self.prefill.resolve(pending)
        return outputs

    # ---- failures -------------------------------------------------------------------------

    def _fail(self, req: Req, message: str, status: int = 400) -> ReqOutput:
        """End a request that holds no KV with an error (``status``: the HTTP status its client
        gets: 400 for what the request asked, 500 for a failure of Loom's own)."""
        req.error = message
        req.finished_reason = {"type": "abort", "message": message, "status_code": status}
        return make_output(req, [])

    def _free(self, req: Req, cache: bool = False) -> None:
        """The request's KV (cached into the prefix tree with ``cache``) and adapter slot."""
        self.cache.release(req, cache=cache)
        self.lora.release(req)

    def _fail_in_step(self, req: Req, error: BaseException | str, status: int = 500) -> None:
        """Fail one request inside a step: it leaves every queue, its KV pages, request row,
        penalty row and adapter slot return, and its error output goes out with the step's.
        A step in flight that still computes its row discards that row's token."""
        if isinstance(error, BaseException):
            logger.error("request %s failed: %s: %s", req.rid, type(error).__name__, error)
            error = f"internal error: {type(error).__name__}: {error}"
        if req.is_finished:
            return
        self.prefill.remove(req)
        self.decode.remove(req)
        self._free(req)
        self.sampler.release(req)
        self._failed.append(self._fail(req, error, status))

    def _recover(self, error: Exception) -> list[ReqOutput]:
        """After a step raised: fail the requests it may have touched (all that hold KV or
        were in flight; after three failed steps in a row, the queued ones too), return their
        pages and carry on. Raises if the state cannot be made whole again (the pages do not
        balance, or the device itself failed): the loop then dies and every request ends with
        the scheduler's error."""
        if self.runner.ranks_failed:
            # another tensor-parallel rank is gone or hung: no step can run again
            raise self.runner.explain_failure(RuntimeError(str(error))) from error
        logger.exception("a scheduler step failed; failing its requests")
        self._failed_steps += 1
        message = f"internal error in the scheduler: {type(error).__name__}: {error}"
        queued = {id(r) for r in self.prefill.waiting} | {id(r) for r in self.grammar_queue}
        keep = self._failed_steps < 3
        if not keep:
            queued = set()
            self.grammar_queue.clear()
        self.prefill.reset(keep_waiting=keep)
        self.decode.reset()
        self.sampler.reset()
        outputs, self._failed = self._failed, []
        for req in list(self._live.values()):
            if id(req) in queued:
                continue
            self._free(req)
            self.sampler.release(req)
            if req.grammar_future is not None:
                req.grammar_future.cancel()
            outputs.append(self._fail(req, message, 500))
            del self._live[req.rid]
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()  # a device fault is sticky: it raises here, and is fatal
        self.check_kv_balance()
        return outputs

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        t = time.perf_counter()
        prefills = self.stats.num_prefill_batches
        decodes, mixed_before = self.stats.num_decode_batches, self.stats.num_mixed_batches
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
        st = self.stats
        dt = time.perf_counter() - t - (st.time_grammar_wait_s - waited)
        if st.num_prefill_batches != prefills:
            # the wait for the decode step still in flight belongs to decode, not to the
            # prefill that follows it
            st.time_prefill_s += dt - self._tail_s
            st.time_decode_s += self._tail_s
            mixed = st.num_mixed_batches != mixed_before
            hist_add(st.step_hist_mixed if mixed else st.step_hist_prefill, dt)
        else:  # and the wait for a prefill still in flight, to prefill
            st.time_decode_s += dt - self._prefill_tail_s
            st.time_prefill_s += self._prefill_tail_s
            if st.num_decode_batches != decodes:
                hist_add(st.step_hist_decode, dt)
        return outputs

    def _step(self) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        decode, prefill = self.decode, self.prefill
        if decode.inflight is not None:
            if self._can_chain():
                # Overlap: launch decode N+1 on N's device-side tokens, then bring N's tokens to
                # the host while the device works.
                if decode.host_before_sampling():
                    # Grammars and logits processors need N's tokens before N+1 is sampled:
                    # only the forward runs ahead; N is resolved (matchers advance, masks fill)
                    # while the device computes N+1's logits.
                    logits, reqs = decode.forward(chained=True)
                    outputs += decode.resolve(decode.inflight)
                    nxt = decode.start_sampling(logits, reqs, pending=0)
                else:
                    nxt = decode.launch(chained=True)
                    outputs += decode.resolve(decode.inflight)
                self.stats.num_overlapped_batches += 1
                decode.inflight = nxt
                return outputs
            if self._can_chain_mixed():
                items = prefill.schedule()
                if items:
                    # Overlap for --enable-mixed-chunk: launch the prefill chunk with the
                    # running requests' next tokens on N's device-side samples, then bring N's
                    # tokens to the host while the device works; the mixed step is the next
                    # one in flight.
                    items += prefill.mixed_decode_items()
                    nxt = prefill.launch(items, chained_on=decode.inflight)
                    outputs += decode.resolve(decode.inflight)
                    decode.inflight = nxt
                    return outputs
            t = time.perf_counter()
            outputs += decode.resolve(decode.inflight)
            self._tail_s = time.perf_counter() - t
            decode.inflight = None
        outputs += self._poll_grammars()
        outputs += self._apply_aborts()
        items = prefill.schedule()
        if prefill.inflight is not None:
            pending, prefill.inflight = prefill.inflight, None
            if items and prefill.may_defer(items):
                # Overlap: launch this prefill, then apply the previous one's first tokens
                # while the device works (nothing here depends on them)
                outputs += prefill.run(items, defer=True)
                outputs += prefill.resolve(pending)
                self.stats.num_overlapped_prefill_batches += 1
                return outputs
            t = time.perf_counter()
            outputs += prefill.resolve(pending)
            self._prefill_tail_s = time.perf_counter() - t
        if items:
            mixed = self.args.enable_mixed_chunk
            if mixed and decode.running:
                items += prefill.mixed_decode_items()
            defer = self.overlap and prefill.may_defer(items)
            if mixed and defer:
                # in flight as a decode step: the next step may chain on its samples
                decode.inflight = prefill.launch(items)
            else:
                outputs += prefill.run(items, defer=defer)
        elif decode.running:
            decode.ensure_room(self._retract, lambda req: outputs.append(self._too_small(req)))
            if decode.running:
                decode.inflight = decode.launch(chained=False)
                if not self.overlap:
                    outputs += decode.resolve(decode.inflight)
                    decode.inflight = None
        elif self.grammar_queue and not outputs:
            # Only compiles are pending: wait a little for one instead of spinning.
            t = time.perf_counter()
            self.grammar_queue.wait(0.005)
            self.stats.time_grammar_wait_s += time.perf_counter() - t
        return outputs

    def _can_chain(self) -> bool:
        """Whether the next step can be launched before the in-flight one is resolved: nothing
        but a decode of the in-flight batch's requests would run (``DecodeManager.chainable``),
        and no waiting request could be admitted now (the costliest check last)."""
        if self._aborts or self.prefill.chunked_req is not None:
            return False
        if not self.decode.chainable():
            return False
        return not self.prefill.waiting or self.prefill.nothing_admissible()

    def _can_chain_mixed(self) -> bool:
        """Whether a mixed step can be launched on the samples of the decode (or mixed) step in
        flight: mixed chunks under overlap, a prompt waits or is being chunked, the running
        batch is that step's (``DecodeManager.chainable``), no running request needs its last
        token on the host before sampling (grammars, logits processors), and no abort, grammar
        compile or prefill in flight is pending."""
        prefill, decode = self.prefill, self.decode
        if not (self.overlap and prefill.enable_mixed_chunk) or self._aborts:
            return False
        if self.grammar_queue or prefill.inflight is not None:
            return False
        if not prefill.waiting and prefill.chunked_req is None:
            return False
        return decode.chainable() and not decode.host_before_sampling()

    def _retract(self, req: Req) -> None:
        self._free(req, cache=True)  # its KV stays reusable until evicted
        self.prefill.waiting.appendleft(req)

    def _too_small(self, req: Req) -> ReqOutput:
        message = "the KV cache is too small for this request (raise --max-total-tokens)"
        req.error = message
        out = self._finish_abort(req, message)
        out.finished_reason["status_code"] = 400
        return out

    # ---- aborts and finishing -------------------------------------------------------------

    def _apply_aborts(self) -> list[ReqOutput]:
        if not self._aborts:
            return []
        outputs = []
        rids, self._aborts = self._aborts, set()
        for req in self.grammar_queue.take(rids):
            req.finished_reason = {"type": "abort", "message": "aborted"}
            outputs.append(make_output(req, []))
        for queue in (self.prefill.waiting, self.decode.running):
            for req in [r for r in queue if r.rid in rids]:
                queue.remove(req)
                outputs.append(self._finish_abort(req))
        chunked = self.prefill.chunked_req
        if chunked is not None and chunked.rid in rids:
            outputs.append(self._finish_abort(chunked))
            self.prefill.chunked_req = None
        return outputs

    def _finish_abort(self, req: Req, message: str = "aborted") -> ReqOutput:
        self._free(req)
        self.sampler.release(req)
        req.finished_reason = {"type": "abort", "message": message}
        return make_output(req, [])

    def _append_all(self, rows: Rows) -> list[ReqOutput]:
        """Apply a step's (req, token, logprob) rows, skipping requests that finished meanwhile
        (overlap ran one step past them); a request whose append raised (its grammar matcher,
        say) fails alone and the rest go on. (One ``try`` around the loop, resumed on the same
        iterator: nothing per row on the way that does not fail.)"""
        outputs: list[ReqOutput] = []
        rows = iter(rows)
        req = None
        while True:
            try:
                for req, tok, lp in rows:
                    if req.is_finished:
                        continue
                    kept = append_token(req, tok, lp, self.eos_token_ids, self.context_len)
                    self.stats.num_generated_tokens += kept
                    if req.is_finished:
                        self._free(req, cache=True)
                        self.sampler.release(req)
                    outputs.append(make_output(req, [tok] if kept else []))
                return outputs
            except Exception as e:  # noqa: BLE001 - isolated to this request
                self._fail_in_step(req, e)

    # ---- invariants -----------------------------------------------------------------------

    def _owners(self, *more) -> list[Req]:
        """Every request that may hold pages or an adapter slot (and those of ``more``)."""
        chunked = [self.prefill.chunked_req] if self.prefill.chunked_req else []
        out = self.decode.running + list(self.prefill.waiting) + chunked
        for group in more:
            out += list(group)
        return out

    def check_kv_balance(self) -> None:
        owners = self._owners()
        self.cache.check_balance(owners)
        self.lora.check_balance(owners)
