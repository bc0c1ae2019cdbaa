"""The Python API: ``loom.Engine``, the front end and its wiring.

The engine runs the scheduler loop on a backend (``backends.py``): a thread of this process
(offline) or a process of its own (``loom serve``). Callers submit requests, checked first
(``validation.py``), through one message per call, and collect ``ReqOutput``s from a
per-request (or per-batch) queue; detokenising and stop strings (``outputs.py``) happen on the
caller's side, so the loop never waits on them. ``streams.py`` holds the stream objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from loom import plugins
from loom.config import ServerArgs
from loom.engine.outputs import ReqState, apply_output, final_result
from loom.engine.streams import AsyncStream, SyncStream
from loom.engine.tokenizer_manager import IncrementalDetokenizer, TokenizerManager
from loom.engine.validation import check_options, logprob_options, prepare_request
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.loop import SchedulerBatchOut
from loom.scheduler.request import Req, ReqOutput

logger = logging.getLogger(__name__)


class Engine:
    """A Loom engine: the front end (tokenizer, detokenizer, stop strings) plus a scheduler loop.

    ``Engine(model=..., **server_args)`` takes the CLI flags as keyword arguments with underscores
    (``max_running_requests=8``). Use it as a context manager or call ``shutdown()``. The loop
    runs in a thread of this process (``backend="thread"``, the default) or, as ``loom serve``
    does, in a scheduler process of its own (``backend="process"``).
    """

    def __init__(self, model: str | None = None, *, backend: str = "thread", **kwargs: Any) -> None:
        from loom.engine.backends import ProcessBackend, ThreadBackend
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
        from loom.lora.adapter import parse_lora_paths

        # adapter names requests may pick (``lora_path``); None: LoRA is off
        self.lora_names = set(parse_lora_paths(args.lora_paths)) if args.enable_lora else None
        self.model_path = resolve_model_path(args.model)
        self.loader = plugins.resolve("model_loader", args.load_format)()
        self.hf_config = self.loader.load_hf_config(self.model_path)
        self.tokenizer_manager: TokenizerManager | None = None
        self._grammar_mgr = None
        tokenizer = None
        if not args.skip_tokenizer_init:
            path = args.tokenizer_path or self.model_path
            tokenizer = self.loader.load_tokenizer(path)
            if tokenizer is None:
                raise ValueError(
                    f"no tokenizer found at {path}; pass --tokenizer-path or --skip-tokenizer-init"
                )
        self.eos_token_ids = self._eos_ids(tokenizer)
        self._states: dict[str, ReqState] = {}
        self._control: dict[str, queue.Queue] = {}  # replies to control messages, by id
        self._states_lock = threading.Lock()
        self._loop_error: BaseException | None = None
        self._stopped = threading.Event()
        self.load: dict[str, Any] = {}  # the scheduler's latest load figures
        self.metrics = None  # set by the HTTP server: observe_output / observe_load
        self.on_failure_hooks: list = []  # called once if the scheduler loop dies
        if backend == "thread":
            self.backend = ThreadBackend(
                args, self.eos_token_ids, self._on_batch, self._on_failure, loader=self.loader
            )
        elif backend == "process":
            self.backend = ProcessBackend(
                args, self.eos_token_ids, self._on_batch, self._on_failure
            )
        else:
            raise ValueError(f"backend must be 'thread' or 'process', got {backend!r}")
        self.info = self.backend.info
        if tokenizer is not None:
            self.tokenizer_manager = TokenizerManager(tokenizer, self.context_len)

    # ---- engine state ---------------------------------------------------------------------

    @property
    def context_len(self) -> int:
        return self.info["context_length"]

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

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

    def _eos_ids(self, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
        gen_config = os.path.join(self.model_path, "generation_config.json")
        if os.path.isfile(gen_config):
            with open(gen_config) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else list(eos or []))
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(tok_eos, int):
            ids.add(tok_eos)
        return ids

    def get_server_info(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.server_args),
            **self.info,
            **self.load,
            "eos_token_ids": sorted(self.eos_token_ids),
        }

    # ---- outputs from the scheduler (called on the backend's thread) -----------------------

    def _on_batch(self, batch: SchedulerBatchOut) -> None:
        self.load = batch.stats
        now = time.monotonic()
        # a batch's shared queue gets the step's outputs as one list: one put and one wake-up
        # of the waiting caller a step, not one per request (each a turn of the interpreter
        # lock taken from this thread when it is the scheduler's)
        grouped: dict[int, tuple[queue.Queue, list[ReqOutput]]] = {}
        for out in batch.outputs:
            with self._states_lock:
                st = self._states.get(out.rid)
                control = self._control.get(out.rid)
            if control is not None:  # the reply to a control message (_control_call)
                control.put(out)
                continue
            if st is not None:
                if self.metrics is not None:
                    self.metrics.observe_output(st, out, now)
                # Stamp times here: the caller may read outputs late.
                if out.new_token_ids:
                    if st.first_token_time is None:
                        st.first_token_time = now
                    st.last_token_time = now
                if out.finished_reason is not None:
                    st.finish_time = now
                if st.shared:
                    grouped.setdefault(id(st.outputs), (st.outputs, []))[1].append(out)
                else:
                    self._put(st, out)
        for q, outs in grouped.values():
            q.put(outs)
        if self.metrics is not None:
            self.metrics.observe_load(batch.stats)

    def _on_failure(self, error: BaseException) -> None:
        self._loop_error = error
        self.end_all(f"the scheduler has failed: {error}")
        for hook in list(self.on_failure_hooks):
            hook(error)

    def end_all(self, message: str, status: int = 503) -> int:
        """End every request in flight with an error (``status``: the HTTP status its client
        gets) and abort it in the scheduler; returns how many there were. Used when the
        scheduler dies and when the server shuts down with requests still running."""
        with self._states_lock:
            states = list(self._states.values())
        for st in states:
            out = ReqOutput(
                st.rid,
                [],
                st.prompt_tokens,
                len(st.output_ids),
                finished_reason={"type": "abort", "message": message, "status_code": status},
                error=message,
            )
            if st.shared:  # a batch's queue takes lists
                st.outputs.put([out])
            else:
                self._put(st, out)
            self.abort_request(st.rid)
        return len(states)

    @staticmethod
    def _put(st: ReqState, out: ReqOutput) -> None:
        if st.loop is not None:
            st.loop.call_soon_threadsafe(st.outputs.put_nowait, out)
        else:
            st.outputs.put(out)

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
            server_args=self.server_args,
            check_constraint=self._check_constraint,
        )

    def _grammar_manager(self):
        if self._grammar_mgr is None:
            from loom.constrained.manager import GrammarManager, build_grammar_backend

            tok, args, vocab = self.tokenizer, self.server_args, self.vocab_size
            eos = set(self.eos_token_ids)
            self._grammar_mgr = GrammarManager(lambda: build_grammar_backend(args, tok, vocab, eos))
        return self._grammar_mgr

    def _check_constraint(self, kind: str, text: str) -> None:
        """Compile the constraint now (cached), so that a bad one is refused at submit time."""
        from concurrent.futures import TimeoutError as FutureTimeout

        if self.tokenizer_manager is None:
            raise ValueError(f"{kind} needs a tokenizer (started with --skip-tokenizer-init)")
        timeout = self.server_args.grammar_compile_timeout
        try:
            self._grammar_manager().compile(kind, text, timeout=timeout)
        except FutureTimeout as e:
            raise ValueError(f"{kind} took longer than {timeout} s to compile") from e

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
        batch: list[Req] | None = None,
        lora: str | None = None,
    ) -> ReqState:
        """``outputs``: a queue shared with other requests of a batch (``_wait_all``), which
        receives lists of outputs. ``batch``: collect the request there for ``_send`` instead
        of sending it now."""
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
        )
        with self._states_lock:
            if rid in self._states:
                raise ValueError(f"duplicate request id {rid!r}")
            self._states[rid] = st
        req = Req(
            rid, input_ids, params, priority=priority or 0, extra_key=extra_key, lora_name=lora
        )
        req.return_logprob, req.top_logprobs_num, req.logprob_start_len = logprob
        if req.return_logprob:
            st.logprobs = {"output_token_logprobs": [], "output_top_logprobs": []}
            if req.logprob_start_len >= 0:
                st.logprobs["input_token_logprobs"] = []
        if batch is None:
            self._send([req])
        else:
            batch.append(req)
        return st

    def _send(self, reqs: list[Req]) -> None:
        """Hand requests to the scheduler in one message: a batch's requests all reach the same
        scheduling step (sent one by one, the scheduler could start on the first few before
        the rest arrived, and a batch's grouping, so its kernels' shapes and rounding, would
        depend on thread timing)."""
        if reqs:
            self.backend.send(("add", reqs))

    def _submit_batch(self, submit: Callable[[list[Req]], list[ReqState]]) -> list[ReqState]:
        """Run ``submit`` (which calls ``_submit`` with its ``batch`` list) and send what it
        collected as one message; if it fails part way, forget the states it registered."""
        reqs: list[Req] = []
        try:
            states = submit(reqs)
        except BaseException:
            with self._states_lock:
                for req in reqs:
                    self._states.pop(req.rid, None)
            raise
        self._send(reqs)
        return states

    def _submit_n(
        self, ids, params, rid, priority, extra_key, lp, outputs=None, batch=None, lora=None
    ) -> list[ReqState]:
        """``n`` samples of one prompt: n requests (rids ``{rid}-{i}``), each with its own
        seed stream when seeded; with n = 1, the one request as given. The scheduler prefills
        the shared prompt once: identical prompts admitted together wait one step for the first
        one's KV (radix cache)."""
        states = []
        for i in range(params.n):
            p, r = params, rid
            if params.n > 1:
                p = dataclasses.replace(params, n=1)
                if p.sampling_seed is not None:
                    p.sampling_seed = p.sampling_seed + i
                r = f"{rid}-{i}" if rid else None
            states.append(
                self._submit(
                    ids,
                    p,
                    r,
                    priority=priority,
                    extra_key=extra_key,
                    logprob=lp,
                    outputs=outputs,
                    batch=batch,
                    lora=lora,
                )
            )
        return states

    def _forget(self, st: ReqState) -> None:
        """The caller went away: abort the request and drop its state."""
        with self._states_lock:
            self._states.pop(st.rid, None)
        if not self._stopped.is_set():
            self.abort_request(st.rid)

    def abort_request(self, rid: str) -> None:
        if self._loop_error is not None or self._stopped.is_set():
            return  # nothing runs any more
        try:
            self.backend.send(("abort", rid))
        except RuntimeError:  # the scheduler just died: _on_failure ends every request
            pass

    @property
    def num_waiting(self) -> int:
        """Requests submitted from this front end that have produced no token yet."""
        with self._states_lock:
            return sum(1 for st in self._states.values() if st.first_token_time is None)

    def flush_cache(self) -> None:
        self.backend.send(("flush_cache", None))

    # ---- collecting outputs ---------------------------------------------------------------

    def _consume(self, st: ReqState, out: ReqOutput) -> dict[str, Any]:
        """Apply one output to the request's state; returns the increment as an SGLang dict.
        A failure here (detokenising, a stop-string check) fails this request alone: it is
        aborted in the scheduler and its increment carries the error."""
        try:
            return self._apply_output(st, out)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            logger.exception("request %s failed in the front end", st.rid)
            message = f"the front end failed on this request: {type(e).__name__}: {e}"
            failed = ReqOutput(
                st.rid,
                [],
                st.prompt_tokens,
                len(st.output_ids),
                finished_reason={"type": "abort", "message": message, "status_code": 500},
                error=message,
            )
            if out.finished_reason is None:
                self.abort_request(st.rid)
            st.detok = None  # (text so far is kept by the caller; no more decoding)
            return self._apply_output(st, failed)

    def _apply_output(self, st: ReqState, out: ReqOutput) -> dict[str, Any]:
        inc = apply_output(st, out, self.tokenizer, self.abort_request)
        if st.finished:
            with self._states_lock:
                self._states.pop(st.rid, None)
        return inc

    def _wait(self, st: ReqState) -> dict[str, Any]:
        while True:
            inc = self._consume(st, st.outputs.get())
            if st.finished:
                return final_result(st, inc)

    def _wait_all(self, states: list[ReqState], shared: queue.Queue) -> list[dict[str, Any]]:
        """The results of requests whose outputs arrive on one ``shared`` queue, consumed in
        arrival order whichever request they belong to: each output is detokenised and checked
        for stop strings as it comes (a request that hit one is aborted at once, not when the
        caller gets to it), and nothing piles up behind the request waited for."""
        index = {st.rid: i for i, st in enumerate(states)}
        results: list[dict[str, Any] | None] = [None] * len(states)
        left = len(states)
        while left:
            got = shared.get()  # a step's outputs (a list), or one (an engine failure's abort)
            for out in got if isinstance(got, list) else [got]:
                i = index[out.rid]
                st = states[i]
                if st.finished:  # (an engine failure's abort after the request's end)
                    continue
                inc = self._consume(st, out)
                if st.finished:
                    results[i] = final_result(st, inc)
                    left -= 1
        return results

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
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a list (a list of dicts, in order).

        Each result is ``{"text", "output_ids", "meta_info"}``; with ``stream=True`` (single
        prompt only) an iterator of increments whose texts concatenate to the full text.

        ``priority`` (higher is scheduled first under ``--schedule-policy priority`` and kept
        longer by ``--radix-eviction-policy priority``) and ``extra_key`` (a prefix-cache
        namespace such as a ``cache_salt``: requests with different keys share no cached KV)
        take one value or, for a batch, one per prompt; so does ``lora_path``, the name of a
        LoRA adapter from ``--lora-paths`` (None: the base model).
        """
        lp = logprob_options(return_logprob, top_logprobs_num, logprob_start_len)
        batch = self._as_batch(prompt, input_ids, sampling_params, rid)
        if batch is None:
            ids, params = self._prepare(prompt, input_ids, sampling_params)
            check_options(priority, extra_key)
            self._check_lora(lora_path)
            if params.n > 1:
                if stream:
                    raise ValueError("stream=True takes n=1")
                shared: queue.Queue = queue.Queue()
                states = self._submit_batch(
                    lambda b: self._submit_n(
                        ids, params, rid, priority, extra_key, lp, shared, b, lora_path
                    )
                )
                return self._wait_all(states, shared)
            st = self._submit(
                ids,
                params,
                rid,
                priority=priority,
                extra_key=extra_key,
                logprob=lp,
                lora=lora_path,
            )
            return self._stream(st) if stream else self._wait(st)
        if stream:
            raise ValueError("stream=True takes a single prompt")
        n = len(batch)
        prios = priority if isinstance(priority, list) else [priority] * n
        keys = extra_key if isinstance(extra_key, list) else [extra_key] * n
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * n
        if len(prios) != n or len(keys) != n or len(loras) != n:
            raise ValueError(
                "priority, extra_key and lora_path lists must match the number of prompts"
            )
        for pr, k, lo in zip(prios, keys, loras, strict=True):
            check_options(pr, k)
            self._check_lora(lo)
        shared = queue.Queue()

        def submit(reqs: list[Req]) -> list[ReqState]:
            states = []
            for (ids, params, r), pr, k, lo in zip(batch, prios, keys, loras, strict=True):
                states += self._submit_n(ids, params, r, pr, k, lp, shared, reqs, lo)
            return states

        return self._wait_all(self._submit_batch(submit), shared)

    # ---- LoRA adapters while serving ------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter from ``path`` under ``name``; requests may use it from then on.
        Raises ValueError naming the problem (unknown path, unsupported adapter, a rank above
        the pool's, a name in use)."""
        if self.lora_names is None:
            raise ValueError("LoRA is off: start the engine with --enable-lora or --lora-paths")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("load_lora_adapter takes a non-empty lora_name and lora_path")
        self._control_call("load_lora", name, path)
        self.lora_names.add(name)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name``; refused while a request that uses it is queued or running."""
        if self.lora_names is None:
            raise ValueError("LoRA is off: start the engine with --enable-lora or --lora-paths")
        self._control_call("unload_lora", name, None)
        self.lora_names.discard(name)

    def _control_call(self, op: str, *payload: Any) -> None:
        """Send a control message to the scheduler and wait for its reply (a ReqOutput whose
        ``error`` is set on failure)."""
        self._check_alive()
        rid = f"loom-control-{uuid.uuid4().hex}"
        reply: queue.Queue = queue.Queue()
        with self._states_lock:
            self._control[rid] = reply
        try:
            self.backend.send((op, (rid, *payload)))
            while True:
                try:
                    out = reply.get(timeout=1.0)
                    break
                except queue.Empty:
                    self._check_alive()
        finally:
            with self._states_lock:
                self._control.pop(rid, None)
        if out.error is not None:
            raise ValueError(out.error)

    def _check_lora(self, name: Any) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ValueError(f"lora_path must be an adapter name (a string), got {name!r}")
        if self.lora_names is None:
            raise ValueError(
                f"LoRA adapter {name!r} requested, but this server has no adapters "
                "(start it with --lora-paths NAME=PATH)"
            )
        if name not in self.lora_names:
            raise ValueError(
                f"unknown LoRA adapter {name!r}; loaded: {', '.join(sorted(self.lora_names))}"
            )

    def _as_batch(self, prompt, input_ids, sampling_params, rid):
        """Validate every item of a batch before submitting any; None for a single request."""
        if isinstance(prompt, list):
            items = [(p, None) for p in prompt]
        elif input_ids is not None and input_ids and isinstance(input_ids[0], list):
            items = [(None, ids) for ids in input_ids]
        else:
            return None
        n = len(items)
        params_list = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        )
        rids = rid if isinstance(rid, list) else [None] * n
        if len(params_list) != n or len(rids) != n:
            raise ValueError("sampling_params and rid lists must match the number of prompts")
        out = []
        for (p, ids), sp, r in zip(items, params_list, rids, strict=True):
            tokens, params = self._prepare(p, ids, sp)
            out.append((tokens, params, r))
        return out

    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        stream: bool = False,
        priority: int | None = None,
        extra_key: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        lora_path: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        """Like ``generate`` for one prompt (n=1); ``stream=True`` returns an async iterator of
        increments (``text`` is the new text, ``output_ids`` the new ids)."""
        lp = logprob_options(return_logprob, top_logprobs_num, logprob_start_len)
        ids, params = self._prepare(prompt, input_ids, sampling_params)
        check_options(priority, extra_key)
        self._check_lora(lora_path)
        if params.n > 1:
            raise ValueError("n > 1: submit n requests (the OpenAI routes do)")
        st = self._submit(
            ids,
            params,
            rid,
            loop=asyncio.get_running_loop(),
            priority=priority,
            extra_key=extra_key,
            logprob=lp,
            lora=lora_path,
        )
        if stream:
            return AsyncStream(st, self._consume, self._forget)
        while True:
            inc = self._consume(st, await st.outputs.get())
            if st.finished:
                return final_result(st, inc)

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
            self._stopped.set()
            self.backend.shutdown()
            if self._grammar_mgr is not None:
                self._grammar_mgr.close()

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
