"""Where the scheduler loop runs: a thread of this process (offline ``Engine``) or a process of its
own talking ZMQ (``loom serve``, so the loop never waits on HTTP). Both expose the same
interface to the front end: ``info`` (what the scheduler learned at start-up), ``send(message)``,
a callback that receives every ``SchedulerBatchOut``, and ``receive_on(loop)``: from then on the
callback runs on that event loop (the HTTP server's) where the backend can arrange it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loom.process import die_with_parent
from loom.scheduler.loop import run_scheduler_loop
from loom.scheduler.messages import Message, SchedulerBatchOut, Shutdown

if TYPE_CHECKING:
    from loom.config import ServerArgs

logger = logging.getLogger(__name__)

OnBatch = Callable[[SchedulerBatchOut], None]
OnFailure = Callable[[BaseException], None]


def _wants_warmup(runner, args: ServerArgs) -> bool:
    """On a GPU (where Triton compiles kernels on first use), unless --skip-warmup."""
    return runner.device.type == "cuda" and not args.skip_warmup


def _build_scheduler(args: ServerArgs, eos_token_ids: set[int], loader: Any = None):
    from loom.engine.warmup import warm_up
    from loom.model_executor.compile_watch import CompileWatch
    from loom.model_executor.model_runner import ModelRunner
    from loom.scheduler.scheduler import Scheduler

    leader = None
    if args.tp_size > 1:
        from loom.model_executor.model_runner import resolve_device
        from loom.model_executor.tp import TPLeader, check_tp_args

        check_tp_args(args)
        leader = TPLeader(args, resolve_device(args.device))
    try:
        runner = ModelRunner(args, loader=loader)
        runner.tp_leader = leader
        if leader is not None:
            leader.attach(runner)
        sched = Scheduler(args, runner, eos_token_ids)
        watch = CompileWatch(sched.stats)
        watch.install()
        if _wants_warmup(runner, args):
            t = time.perf_counter()
            warm_up(sched)  # Triton compiles before the first request, not inside it
            logger.info("warm-up took %.2f s", time.perf_counter() - t)
    except BaseException:
        # the ranks stop and this process leaves their group: a later engine here starts anew
        if leader is not None:
            leader.close()
        raise
    watch.armed = runner.device.type == "cuda"  # (the CPU runs no Triton kernels)
    if runner.device.type == "cuda":
        # What start-up built (the model's modules, graphs, compiled kernels) lives until
        # shutdown: keep it out of the collector's full passes, which otherwise walk it all
        # while a decode step waits to be launched (as vLLM does after graph capture).
        gc.collect()
        gc.freeze()
    info = {
        "model_path": runner.model_path,
        "architecture": runner.model_config.architecture,
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention_backend": runner.attention_backend_name,
        "prefill_attention_backend": runner.prefill_attention_backend_name,
        "decode_attention_backend": runner.decode_attention_backend_name,
        "max_total_tokens": runner.max_total_tokens,
        "max_running_requests": runner.max_running_requests,
        "context_length": runner.model_config.context_len,
        "vocab_size": runner.vocab_size,
        "page_size": args.page_size,
        "scheduler_pid": os.getpid(),
        "cuda_graphs": runner.cuda_graph_runner is not None,
        "tp_size": args.tp_size,
    }
    return runner, sched, info


class ThreadBackend:
    """The scheduler loop in a daemon thread of this process.

    The model is built on that same thread, so all torch work happens on one thread: on CPU,
    OpenMP work issued from a second thread after the first has used its own OpenMP team ran
    ~1.7x slower here (measured: small matmuls, 2 cores).
    """

    separate_process = False

    def __init__(
        self,
        args: ServerArgs,
        eos_token_ids: set[int],
        on_batch: OnBatch,
        on_failure: OnFailure,
        loader: Any = None,
    ) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._on_batch = on_batch
        self._on_failure = on_failure
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="loom-scheduler", daemon=True, args=(args, eos_token_ids, loader)
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _poll(self, timeout: float) -> list[Message]:
        msgs = []
        try:
            msgs.append(
                self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            )
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _run(self, args: ServerArgs, eos_token_ids: set[int], loader: Any) -> None:
        try:
            self.runner, self.scheduler, self.info = _build_scheduler(args, eos_token_ids, loader)
        except BaseException as e:
            self._start_error = e
            return
        finally:
            self._ready.set()
        try:
            run_scheduler_loop(self.scheduler, self._poll, self._on_batch, self._stopped.is_set)
        except BaseException as e:  # never leave callers waiting forever
            logger.exception("scheduler loop crashed")
            self._on_failure(e)

    def send(self, message: Message) -> None:
        self._inbox.put(message)

    def receive_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Outputs stay on the scheduler's thread (handed to loops one callback a step)."""

    def stop_receiving(self) -> None:
        pass

    def shutdown(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


# ---- the scheduler process --------------------------------------------------------------------


def scheduler_process_main(
    args: ServerArgs,
    eos_token_ids: set[int],
    in_addrs: list[str],
    out_addrs: list[str],
    parent_pid: int,
) -> None:
    """The scheduler process: one pair of sockets per front end (``in_addrs[i]`` /
    ``out_addrs[i]``, bound by front end ``i``); with several, each request's outputs go back
    to the front end that sent it (``front_ends.OwnerRouting``)."""
    import zmq

    from loom.engine.front_ends import OwnerRouting

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's to handle
    logging.basicConfig(
        level=args.log_level.upper(),
        format="[scheduler %(process)d] %(levelname)s %(name)s: %(message)s",
    )
    ctx = zmq.Context()
    pulls, pushes = [], []
    for in_addr, out_addr in zip(in_addrs, out_addrs, strict=True):
        pull = ctx.socket(zmq.PULL)
        pull.connect(in_addr)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)  # a front end behind by many steps is queued, not lost
        push.connect(out_addr)
        pulls.append(pull)
        pushes.append(push)
    try:
        _, sched, info = _build_scheduler(args, eos_token_ids)
    except BaseException as e:
        pushes[0].send_pyobj(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    pushes[0].send_pyobj(("ready", info))
    if len(pulls) == 1:
        poller = zmq.Poller()
        poller.register(pulls[0], zmq.POLLIN)
        pull = pulls[0]

        def poll(timeout: float) -> list[Message]:
            msgs = []
            if timeout > 0 and not poller.poll(int(timeout * 1000)):
                return msgs
            while True:
                try:
                    msgs.append(pull.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    return msgs

        emit = pushes[0].send_pyobj
    else:
        routing = OwnerRouting(pulls, pushes)
        poll, emit = routing.poll, routing.emit

    try:
        run_scheduler_loop(sched, poll, emit, lambda: os.getppid() != parent_pid)
    except BaseException as e:
        logger.exception("scheduler loop crashed")
        for push in pushes:
            with contextlib.suppress(Exception):
                push.send_pyobj(("fatal", f"{type(e).__name__}: {e}"), zmq.NOBLOCK)
        os._exit(1)
    finally:
        for push in pushes:
            push.close(linger=1000)
        for pull in pulls:
            pull.close(linger=0)


class ProcessBackend:
    """The scheduler loop in a child process; messages travel over ZMQ IPC sockets.

    Only this machine's own processes are on either end of the sockets (a private temporary
    directory), so Python objects are sent with pickle, as SGLang does between its processes.
    """

    separate_process = True

    def __init__(
        self,
        args: ServerArgs,
        eos_token_ids: set[int],
        on_batch: OnBatch,
        on_failure: OnFailure,
        start_timeout: float = 600.0,
        front_ends: int = 1,
    ) -> None:
        """``front_ends``: this front end and ``front_ends - 1`` more, each attached later from
        a process of its own through one of ``slots`` (``front_ends.AttachedBackend``)."""
        import zmq

        from loom.engine.front_ends import FrontEndSlot

        self._on_batch = on_batch
        self._on_failure = on_failure
        self.receive_s = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None  # set by receive_on
        self._failed = False  # the failure was reported (once)
        self._dir = tempfile.mkdtemp(prefix="loom-ipc-")
        in_addrs = [f"ipc://{self._dir}/in{i}" for i in range(front_ends)]
        out_addrs = [f"ipc://{self._dir}/out{i}" for i in range(front_ends)]
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # queue without bound: send() fails only peerless
        self._push.bind(in_addrs[0])
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addrs[0])
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self.slots: list[FrontEndSlot] = []
        mp = multiprocessing.get_context("spawn")
        self.process = mp.Process(
            target=scheduler_process_main,
            name="loom-scheduler",
            args=(args, eos_token_ids, in_addrs, out_addrs, os.getpid()),
            daemon=True,
        )
        self.process.start()
        self.info = self._wait_ready(start_timeout)
        self.info["front_ends"] = front_ends
        self.info["front_end"] = 0
        self.slots = [
            FrontEndSlot(i, in_addrs[i], out_addrs[i], {**self.info, "front_end": i})
            for i in range(1, front_ends)
        ]
        self._receiver = threading.Thread(target=self._receive, name="loom-receiver", daemon=True)
        self._receiver.start()

    def _alive(self) -> bool:
        return self.process.is_alive()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        waited = 0.0
        while waited < timeout:
            if self._pull.poll(200):
                msg = self._pull.recv_pyobj()
                if msg[0] == "ready":
                    return msg[1]
                self.shutdown()
                raise RuntimeError(f"the scheduler process failed to start: {msg[1]}\n{msg[2]}")
            waited += 0.2
            if not self.process.is_alive():
                self.shutdown()
                raise RuntimeError(
                    "the scheduler process exited during start-up with code "
                    f"{self.process.exitcode}"
                )
        self.shutdown()
        raise TimeoutError(f"the scheduler process did not start within {timeout:.0f} s")

    def _receive(self) -> None:
        """The receiving thread, until ``receive_on`` hands receiving to an event loop."""
        import zmq

        while not self._stopping.is_set() and self._loop is None:
            try:
                ready = self._pull.poll(200)
            except zmq.ZMQError:
                return
            if ready:
                if not self._handle(self._recv()):
                    return
            elif not self._alive() and not self._stopping.is_set():
                self._died()
                return

    def _recv(self) -> Any:
        t = time.perf_counter()
        msg = self._pull.recv_pyobj()
        self.receive_s += time.perf_counter() - t  # taking it off the socket, unpickling
        return msg

    def _handle(self, msg: Any) -> bool:
        """Route one message from the scheduler; False once it reported its failure."""
        if isinstance(msg, SchedulerBatchOut):
            self._on_batch(msg)
            return True
        if msg[0] in ("fatal", "died") and not self._failed:
            self._failed = True
            error = f"the scheduler process failed: {msg[1]}" if msg[0] == "fatal" else msg[1]
            self._on_failure(RuntimeError(error))
        return False

    def _died(self) -> None:
        if not self._failed:
            self._failed = True
            error = f"the scheduler process died (exit code {self.process.exitcode})"
            self._tell_front_ends(error)
            self._on_failure(RuntimeError(error))

    def _tell_front_ends(self, error: str) -> None:
        """The other front ends learn of the scheduler's death from a ``died`` message on their
        output sockets."""
        import zmq

        for slot in self.slots:
            sock = self._ctx.socket(zmq.PUSH)
            try:
                sock.connect(slot.out_addr)
                sock.send_pyobj(("died", error), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            finally:
                sock.close(linger=500)

    # ---- receiving on an event loop -----------------------------------------------------------

    def receive_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take the scheduler's outputs on ``loop`` (the HTTP server's, from its start-up) from
        now on, instead of on the receiving thread: a step's outputs then reach the requests
        waiting on that loop with no thread hop, and no second thread competes for the
        interpreter lock while the loop streams. A thread of its own only watches the process
        (blocked in the kernel, holding no lock)."""
        import zmq

        if self._loop is not None:
            return
        self._loop = loop
        self._receiver.join()  # it stops within one poll interval
        self._fd = self._pull.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # what arrived before the reader was registered
        self._receiver = threading.Thread(target=self._watch, name="loom-watch", daemon=True)
        self._receiver.start()

    def _drain(self, limit: int = 16) -> None:
        """On the loop: route what the socket holds. ZMQ's descriptor signals only a change, so
        it is read until empty (``EVENTS``), at most ``limit`` messages before the loop's other
        callbacks run again."""
        import zmq

        for _ in range(limit):
            try:
                if not self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                msg = self._recv()
            except zmq.ZMQError:  # closed by shutdown
                return
            if not self._handle(msg):
                self._stop_reading()
                return
        self._loop.call_soon(self._drain)

    def stop_receiving(self) -> None:
        """On the loop given to ``receive_on``, before it closes: route nothing more there."""
        if self._loop is not None:
            self._stop_reading()

    def _stop_reading(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)

    def _watch(self) -> None:
        """Wait for the scheduler process to exit; unless that is a shutdown, report its death
        after the loop has routed what it sent last (its own error, if it sent one)."""
        while self.process.is_alive() and not self._stopping.is_set():
            self.process.join(timeout=0.5)
        if self._stopping.is_set():
            return
        done = threading.Event()

        def last_drain() -> None:
            try:
                self._drain(limit=1 << 30)
            finally:
                done.set()

        with contextlib.suppress(RuntimeError):  # a closed loop
            self._loop.call_soon_threadsafe(last_drain)
            done.wait(timeout=2.0)
        if not self._stopping.is_set():
            self._died()

    def send(self, message: Message) -> None:
        """Never blocks: a PUSH socket's blocking send waits forever once its peer is gone (a
        dead scheduler), and the caller may be the HTTP server's event loop, which would then
        stop answering anything, signals included."""
        import zmq

        with self._send_lock:
            while True:
                try:
                    self._push.send_pyobj(message, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    # no peer yet, or one that stopped reading: wait only while it lives
                    if self._stopping.is_set() or not self._alive():
                        raise RuntimeError("the scheduler process is not running") from None
                    time.sleep(0.001)

    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop the scheduler: asked first, killed if it has not exited within ``timeout``."""
        if self._stopping.is_set():
            return
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.send(Shutdown())
        self._stopping.set()
        if self.process.is_alive():
            self.process.join(timeout=timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout=2)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (a closed loop has no readers left)
                self._loop.call_soon_threadsafe(self._stop_reading)
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
