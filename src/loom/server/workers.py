"""The front ends beyond the first (``loom serve --tokenizer-worker-num N``): N - 1 processes,
each an HTTP server with its own tokenizer and detokenizer, attached to the scheduler that the
first front end started (``engine.front_ends``). Every front end listens on a socket of its own
bound to the same address with ``SO_REUSEPORT``, so the kernel spreads new connections over
them by their addresses' hash (on one shared socket, the process that wakes first accepts every
pending connection: a burst of them all lands on one front end).

The first front end (this module's caller) supervises them: it starts them and waits until
each serves, passes a shutdown signal on, waits for them to exit before it stops the scheduler,
and shuts the whole server down (status 1) if one of them dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from loom.process import die_with_parent

logger = logging.getLogger("loom.serve")

START_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 7.0  # the others drain as this process does (launch.DRAIN_S + uvicorn's 1 s)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` that the other front ends' sockets share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def front_end_main(server_kwargs: dict[str, Any], slot, metrics_dir: str, ready) -> None:
    """A front-end process: an ``Engine`` attached through ``slot``, serving HTTP."""
    die_with_parent()
    logging.basicConfig(
        level=server_kwargs.get("log_level", "warning").upper(),
        format=f"[front end {slot.index}] %(levelname)s %(name)s: %(message)s",
    )
    from loom.engine.engine import Engine
    from loom.server.launch import run_front_end

    engine = Engine(backend=slot, **server_kwargs)
    args = engine.server_args
    sockets = [listening_socket(args.host, args.port)]
    sys.exit(run_front_end(engine, sockets=sockets, metrics_dir=metrics_dir, on_ready=ready.set))


class FrontEndWorkers:
    """The other front-end processes of a server, from the first front end's side."""

    def __init__(self, engine, server_kwargs: dict[str, Any]) -> None:
        self.slots = engine.backend.slots
        self.server_kwargs = server_kwargs
        self.metrics_dir = tempfile.mkdtemp(prefix="loom-metrics-")
        self.processes: list = []
        self._stopping = threading.Event()
        self._signalled = False
        self._lock = threading.Lock()

    def start(self, on_exit: Callable[[int, int | None], None]) -> None:
        """Start every process and wait until each serves; ``on_exit(index, code)`` is called
        (on a thread) if one exits before ``signal``. RuntimeError if one fails to start."""
        mp = multiprocessing.get_context("spawn")
        events = []
        for slot in self.slots:
            ready = mp.Event()
            process = mp.Process(
                target=front_end_main,
                name=f"loom-front-end-{slot.index}",
                args=(self.server_kwargs, slot, self.metrics_dir, ready),
                daemon=True,
            )
            process.start()
            self.processes.append(process)
            events.append(ready)
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot, process, ready in zip(self.slots, self.processes, events, strict=True):
            while not ready.wait(0.2):
                if not process.is_alive():
                    self.kill()
                    raise RuntimeError(
                        f"front-end process {slot.index} exited during start-up with code "
                        f"{process.exitcode}"
                    )
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"front-end process {slot.index} did not start in time")
        for slot, process in zip(self.slots, self.processes, strict=True):
            threading.Thread(
                target=self._watch, args=(slot.index, process, on_exit), daemon=True
            ).start()

    def _watch(self, index: int, process, on_exit) -> None:
        process.join()
        if not self._stopping.is_set():
            on_exit(index, process.exitcode)

    def signal(self) -> None:
        """Pass a shutdown on: each process drains its requests and exits on its own."""
        with self._lock:
            if self._signalled:
                return
            self._signalled = True
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def join(self) -> None:
        """Wait for every process to exit (before the scheduler stops); kill what is left."""
        self.signal()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        self._stopping.set()
        for process in self.processes:
            if process.is_alive():
                process.kill()

    def close(self) -> None:
        self.kill()
        for process in self.processes:
            process.join(timeout=5)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
