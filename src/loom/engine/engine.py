"""The Python API: ``loom.Engine``, the front end and its wiring.

The scheduler loop runs on a backend (``backends.py``): a thread of this process or a process
of its own (``loom serve``). A call's requests are fanned out and checked (``fan_out.py``,
``validation.py``), sent in one message (``scheduler/messages.py``), and their outputs routed
back (``router.py``); detokenising and stop strings (``outputs.py``) run on the caller's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from loom import plugins
from loom.config import ServerArgs
from loom.engine.control import ControlCalls
from loom.engine.fan_out import fan_out_call
from loom.engine.outputs import OutputConsumer, ReqState, final_result, wait_all
from loom.engine.profile import FrontendProfile
from loom.engine.router import OutputRouter
from loom.engine.streams import AsyncStream, SyncStream, drain
from loom.engine.tokenizer_manager import (
    IncrementalDetokenizer,
    TokenizerManager,
    eos_token_ids,
)
from loom.engine.validation import ConstraintChecker, check_lora, prepare_request
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.messages import (
    Abort,
    AddRequests,
    FlushCache,
    GenerateRequest,
    SchedulerBatchOut,
)

if TYPE_CHECKING:
    from loom.engine.front_ends import FrontEndSlot


class Engine(ControlCalls):
    """A Loom engine: the front end (tokenizer, detokenizer, stop strings) plus a scheduler loop.

    ``Engine(model=..., **server_args)`` takes the CLI flags as keyword arguments with underscores
    (``max_running_requests=8``). Use it as a context manager or call ``shutdown()``. The loop
    runs in a thread of this process (``backend="thread"``, the default) or, as ``loom serve``
    does, in a scheduler process of its own (``"process"``; ``"serve"`` adds the slots that the
    other front ends of ``--tokenizer-worker-num`` attach to)."""

    def __init__(
        self, model: str | None = None, *, backend: str | FrontEndSlot = "thread", **kwargs: Any
    ) -> None:
        from loom.engine.backends import ProcessBackend, ThreadBackend
        from loom.engine.front_ends import AttachedBackend, FrontEndSlot
        from loom.model_loader.model_path import resolve_model_path

        if model is not None:
            kwargs["model"] = model
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        logging.getLogger("loom").setLevel(args.log_level.upper())
        plugins.ensure_loaded()
        # Resolve every plug-in named by the arguments now, so a bad name fails at start-up.
        self.radix_eviction_policy = plugins.resolve(
            "radix_eviction_policy", args.radix_eviction_policy
        )
        plugins.resolve("schedule_policy", args.schedule_policy)
        from loom.lora.registry import LoRARegistry, parse_lora_paths

        # the adapters requests may pick (``lora_path``) and their requests in flight; None:
        # LoRA is off
        self.lora_registry = (
            LoRARegistry(parse_lora_paths(args.lora_paths)) if args.enable_lora else None
        )
        self.model_path = resolve_model_path(args.model)
        self.loader = plugins.resolve("model_loader", args.load_format)()
        self.hf_config = self.loader.load_hf_config(self.model_path)
        self.tokenizer_manager: TokenizerManager | None = None
        tokenizer = None
        if not args.skip_tokenizer_init:
            path = args.tokenizer_path or self.model_path
            tokenizer = self.loader.load_tokenizer(path)
            if tokenizer is None:
                raise ValueError(
                    f"no tokenizer found at {path}; pass --tokenizer-path or --skip-tokenizer-init"
                )
        self.eos_token_ids = eos_token_ids(self.hf_config, self.model_path, tokenizer)
        self.profile = FrontendProfile()
        self.router = OutputRouter(self.profile)
        if self.lora_registry is not None:
            self.router.lora_release = self.lora_registry.release
        self._loop_error: BaseException | None = None
        self._stopped = threading.Event()
        self.load: dict[str, Any] = {}  # the scheduler's latest load figures
        self._lora_refs = None  # the scheduler's adapters, last seen (several front ends)
        self.on_failure_hooks: list = []  # called once if the scheduler loop dies
        self.before_shutdown: list = []  # called (once) before shutdown stops the scheduler
        hooks = (args, self.eos_token_ids, self._on_batch, self._on_failure)
        if isinstance(backend, FrontEndSlot):  # one of several front ends of ``loom serve``
            self.backend = AttachedBackend(backend, self._on_batch, self._on_failure)
        elif backend == "thread":
            self.backend = ThreadBackend(*hooks, loader=self.loader)
        elif backend in ("process", "serve"):  # serve: --tokenizer-worker-num front ends
            fronts = args.tokenizer_worker_num if backend == "serve" else 1
            self.backend = ProcessBackend(*hooks, front_ends=fronts)
        else:
            raise ValueError(
                f"backend must be 'thread', 'process', 'serve' or a FrontEndSlot, got {backend!r}"
            )
        self.info = self.backend.info
        if tokenizer is not None:
            self.tokenizer_manager = TokenizerManager(
                tokenizer, self.context_len, args.chat_template
            )
        # applies outputs to their requests on the caller's side (``outputs.OutputConsumer``)
        self._consume = OutputConsumer(
            self.tokenizer, self.abort_request, self.router.forget, self.profile
        )
        self.constraints = ConstraintChecker(
            args.grammar_args, self.tokenizer, self.vocab_size, self.eos_token_ids
        )

    # ---- engine state ---------------------------------------------------------------------

    @property
    def context_len(self) -> int:
        return self.info["context_length"]

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    @property
    def lora_names(self) -> set[str] | None:
        """The adapters' names, or None when LoRA is off."""
        return None if self.lora_registry is None else set(self.lora_registry.names)

    @property
    def tokenizer(self) -> Any:
        return self.tokenizer_manager.tokenizer if self.tokenizer_manager else None

    @property
    def runner(self):
        """The model runner (in-process backend only; tests and benchmarks use it)."""
        return self.backend.runner

    @property
    def scheduler(self):
        """The scheduler (in-process backend only)."""
        return self.backend.scheduler

    def get_server_info(self) -> dict[str, Any]:
        scheduler_cpu = self.load.get("process_cpu_s") if self.backend.separate_process else None
        return {
            **self.server_args.to_dict(),
            **self.info,
            **self.load,
            "eos_token_ids": sorted(self.eos_token_ids),
            "profile": {
                **self.profile.snapshot(scheduler_cpu),
                "receive_s": getattr(self.backend, "receive_s", 0.0),
            },
        }

    # ---- outputs from the scheduler (called on the backend's thread) -----------------------

    @property
    def metrics(self):
        """The HTTP server's metrics (``observe_outputs`` / ``observe_load``), or None."""
        return self.router.metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self.router.metrics = value

    def _on_batch(self, batch: SchedulerBatchOut) -> None:
        t = time.perf_counter()
        self.load = batch.stats
        refs = batch.stats.get("lora_refs")
        if refs is not None and refs != self._lora_refs:  # (several front ends)
            self._lora_refs = refs
            self.lora_registry.sync(refs)
        self.router.on_batch(batch)
        self.profile.output_messages += 1
        self.profile.output_message_s += time.perf_counter() - t

    def _on_failure(self, error: BaseException) -> None:
        self._loop_error = error
        self.end_all(f"the scheduler has failed: {error}")
        for hook in list(self.on_failure_hooks):
            hook(error)

    def end_all(self, message: str, status: int = 503) -> int:
        """End every request in flight with an error (``status``: the HTTP status its client
        gets) and abort it in the scheduler; returns how many there were. Used when the
        scheduler dies and when the server shuts down with requests still running."""
        return self.router.end_all(message, status, self.abort_request)

    # ---- submission -----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._loop_error is not None:
            raise RuntimeError(f"the engine's scheduler loop has failed: {self._loop_error}")
        if self._stopped.is_set():
            raise RuntimeError("the engine has been shut down")

    def _prepare(
        self,
        prompt: str | None,
        input_ids: list[int] | None,
        sampling_params: dict[str, Any] | SamplingParams | None,
    ) -> tuple[list[int], SamplingParams]:
        return prepare_request(
            prompt,
            input_ids,
            sampling_params,
            vocab_size=self.vocab_size,
            context_len=self.context_len,
            tokenizer_manager=self.tokenizer_manager,
            sampling_args=self.server_args.sampling_args,
            check_constraint=self.constraints.check,
        )

    def _submit(
        self,
        input_ids: list[int],
        params: SamplingParams,
        rid: str | None,
        loop: asyncio.AbstractEventLoop | None = None,
        priority: int | None = None,
        extra_key: str | None = None,
        logprob: tuple[bool, int, int] = (False, 0, -1),
        outputs: queue.Queue | None = None,
        batch: list[GenerateRequest] | None = None,
        lora: str | None = None,
        logprob_text: bool = True,
        prompt_ids: bool = False,
    ) -> ReqState:
        """``outputs``: a queue shared with other requests of a batch (``wait_all``), which
        receives lists of outputs. ``batch``: collect the request there for ``_send`` instead
        of sending it now. ``logprob_text``: logprob entries carry their token's text;
        ``prompt_ids``: results carry ``prompt_token_ids``."""
        self._check_alive()
        rid = rid or uuid.uuid4().hex
        detok = None
        if self.tokenizer_manager is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        st = ReqState(
            rid,
            len(input_ids),
            params,
            outputs if outputs is not None else (asyncio.Queue() if loop else queue.Queue()),
            loop,
            detok,
            shared=outputs is not None,
            logprob_text=logprob_text,
            prompt_ids=list(input_ids) if prompt_ids else None,
        )
        if lora is not None:
            # counted until the router forgets the request (an unload waits for it)
            st.lora_id = self.lora_registry.acquire(lora).lora_id
        try:
            self.router.register(st)
        except ValueError:
            if st.lora_id is not None:
                self.lora_registry.release(st.lora_id)
            raise
        req = GenerateRequest(
            rid, input_ids, params, priority or 0, extra_key, lora, st.lora_id, *logprob
        )
        st.expect_logprobs(req)
        if batch is None:
            self._send([req])
        else:
            batch.append(req)
        return st

    def _send(self, reqs: list[GenerateRequest]) -> None:
        """Hand requests to the scheduler in one message: a batch's requests all reach the same
        scheduling step (sent one by one, the scheduler could start on the first few before
        the rest arrived, and a batch's grouping, so its kernels' shapes and rounding, would
        depend on thread timing)."""
        if reqs:
            self.backend.send(AddRequests(reqs))

    def _submit_batch(
        self, submit: Callable[[list[GenerateRequest]], list[ReqState]]
    ) -> list[ReqState]:
        """Run ``submit`` (which calls ``_submit`` with its ``batch`` list) and send what it
        collected as one message; if it fails part way, forget the states it registered."""
        reqs: list[GenerateRequest] = []
        try:
            states = submit(reqs)
        except BaseException:
            for req in reqs:
                self.router.forget(req.rid)
            raise
        self._send(reqs)
        return states

    def _submit_all(self, rows, loop=None, shared=None, **options) -> list[ReqState]:
        """Submit ``fan_out``'s rows in one message to the scheduler (``options``: ``_submit``'s
        ``logprob_text`` and ``prompt_ids``)."""

        def submit(reqs: list[GenerateRequest]) -> list[ReqState]:
            return [
                self._submit(
                    ids,
                    p,
                    r,
                    loop=loop,
                    priority=pr,
                    extra_key=k,
                    logprob=lp,
                    outputs=shared,
                    batch=reqs,
                    lora=lo,
                    **options,
                )
                for ids, p, r, pr, k, lo, lp in rows
            ]

        return self._submit_batch(submit)

    def _forget(self, st: ReqState) -> None:
        """The caller went away: abort the request and drop its state."""
        self.router.forget(st.rid)
        if not self._stopped.is_set():
            self.abort_request(st.rid)

    def abort_request(self, rid: str) -> None:
        if self._loop_error is not None or self._stopped.is_set():
            return  # nothing runs any more
        try:
            self.backend.send(Abort(rid))
        except RuntimeError:  # the scheduler just died: _on_failure ends every request
            pass

    @property
    def num_waiting(self) -> int:
        """Requests submitted from this front end that have produced no token yet."""
        return sum(1 for st in self.router.all() if st.first_token_time is None)

    def flush_cache(self) -> None:
        self.backend.send(FlushCache())

    # ---- collecting outputs ---------------------------------------------------------------

    def _wait(self, st: ReqState) -> dict[str, Any]:
        while True:
            q = st.outputs
            inc = self._consume(st, drain(q, q.get()))
            if st.finished:
                return final_result(st, inc)

    def _stream(self, st: ReqState) -> SyncStream:
        return SyncStream(st, self._consume, self._forget)

    # ---- public API -----------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        stream: bool = False,
        priority: int | list[int] | None = None,
        extra_key: str | list[str] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        logprob_start_len: int | list[int] = -1,
        lora_path: str | list[str | None] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        *,
        return_text_in_logprobs: bool = True,
        return_prompt_token_ids: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a list (a list of dicts, in order).

        Each result is ``{"text", "output_ids", "meta_info"}``; with ``stream=True`` (single
        prompt only) an iterator of increments whose texts concatenate to the full text.

        ``priority`` (higher is scheduled first under ``--schedule-policy priority`` and kept
        longer by ``--radix-eviction-policy priority``) and ``extra_key`` (a prefix-cache
        namespace such as a ``cache_salt``: requests with different keys share no cached KV)
        take one value or, for a batch, one per prompt; so do ``lora_path``, the name of a
        LoRA adapter from ``--lora-paths`` (None: the base model), the logprob options, and
        ``custom_logit_processor``: a processor installed on the server by name, or SGLang's
        serialised ``CustomLogitProcessor.to_str()`` (only with
        ``--enable-custom-logit-processor``). ``token_ids_logprob`` (with ``return_logprob``)
        adds the logprobs of those ids at every output position (``output_token_ids_logprobs``)
        and prompt position (``input_token_ids_logprobs``, from ``logprob_start_len``): a list
        of ids for every prompt, or one list per prompt. ``return_text_in_logprobs=False``
        gives None in place of each logprob entry's text (SGLang's default);
        ``return_prompt_token_ids`` adds the prompt's ids to each result (``prompt_token_ids``).
        """
        rows, many = self._fan_out(locals())
        out = {"logprob_text": return_text_in_logprobs, "prompt_ids": return_prompt_token_ids}
        if not many:
            st = self._submit_all(rows, **out)[0]
            return self._stream(st) if stream else self._wait(st)
        if stream:
            raise ValueError("stream=True takes a single prompt with n=1")
        shared: queue.Queue = queue.Queue()
        return wait_all(self._submit_all(rows, shared=shared, **out), shared, self._consume.one)

    # ---- LoRA adapters while serving ------------------------------------------------------

    def _fan_out(self, args: dict[str, Any]) -> tuple[list[tuple], bool]:
        return fan_out_call(self._prepare, self._check_lora, args, self.vocab_size)

    def _check_lora(self, name: Any) -> None:
        check_lora(name, self.lora_names)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        stream: bool = False,
        priority: int | list[int] | None = None,
        extra_key: str | list[str] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        logprob_start_len: int | list[int] = -1,
        lora_path: str | list[str | None] | None = None,
        custom_logit_processor: str | list[str | None] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        *,
        return_text_in_logprobs: bool = True,
        return_prompt_token_ids: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]] | list:
        """Like ``generate``, awaited: one prompt (n=1) gives a result, a batch or ``n > 1`` a
        list of results (prompt-major, its samples in order), every request submitted in one
        message. ``stream=True`` returns an async iterator of increments (``text`` is the new
        text, ``output_ids`` the new ids), or for a batch or ``n > 1`` a list of them."""
        rows, many = self._fan_out(locals())
        out = {"logprob_text": return_text_in_logprobs, "prompt_ids": return_prompt_token_ids}
        states = self._submit_all(rows, loop=asyncio.get_running_loop(), **out)
        if stream:
            streams = [AsyncStream(st, self._consume, self._forget) for st in states]
            return streams if many else streams[0]
        results = await asyncio.gather(*(self._await_result(st) for st in states))
        return list(results) if many else results[0]

    async def _await_result(self, st: ReqState) -> dict[str, Any]:
        try:
            while True:
                q = st.outputs
                inc = self._consume(st, drain(q, await q.get()))
                if st.finished:
                    return final_result(st, inc)
        except asyncio.CancelledError:
            self._forget(st)
            raise

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer_manager is None:
            raise ValueError("chat needs a tokenizer (started with --skip-tokenizer-init)")
        return self.tokenizer_manager.apply_chat_template(messages)

    def chat(
        self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Generate a reply to chat ``messages`` through the model's chat template."""
        return self.generate(
            input_ids=self.apply_chat_template(messages), sampling_params=sampling_params
        )

    def shutdown(self) -> None:
        if not self._stopped.is_set():
            for hook in self.before_shutdown:
                hook()
            self._stopped.set()
            self.backend.shutdown()
            if getattr(self, "constraints", None) is not None:
                self.constraints.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None and not self._stopped.is_set():
            self._stopped.set()
            with contextlib.suppress(Exception):
                backend.shutdown()
