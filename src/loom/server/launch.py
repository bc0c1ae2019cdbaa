"""``loom serve``: the front end in this process, the scheduler in a child process, and with
``--tokenizer-worker-num N`` N - 1 more front ends in processes of their own
(``workers.FrontEndWorkers``), all serving one listening socket.

Shutdown always completes within ``EXIT_DEADLINE_S`` of SIGTERM / SIGINT (or of the scheduler's
death, which raises SIGTERM here), whatever state any process is in:
1. uvicorn stops accepting connections and lets running requests finish (every front end: this
   process passes the signal on to the others);
2. after ``DRAIN_S`` the requests still running end with a 503 error (an error event on a
   stream), so no client sees a cut connection or a normal-looking empty answer;
3. the lifespan hook waits for the other front ends to exit, then stops the scheduler (asked,
   then killed after a few seconds);
4. a watchdog thread, started by the first signal, kills the scheduler and the other front ends
   and exits the process at the deadline if anything above hangs (Python runs signal handlers
   only on the main thread between bytecodes, so the watchdog itself runs on a thread of its
   own).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("loom.serve")

DRAIN_S = 4.0  # running requests may finish this long after the signal
EXIT_DEADLINE_S = 9.5  # the process is gone by then, in any case


def serve(server_kwargs: dict[str, Any]) -> int:
    from loom.config import ServerArgs
    from loom.engine.engine import Engine

    logging.basicConfig(
        level=server_kwargs.get("log_level", "warning").upper(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if server_kwargs.get("node_rank"):  # another host's tensor-parallel ranks: no front end
        from loom.model_executor.tp import run_node

        return run_node(ServerArgs.from_kwargs(**server_kwargs))
    engine = Engine(backend="serve", **server_kwargs)
    workers = None
    if engine.server_args.tokenizer_worker_num > 1:
        from loom.server.workers import FrontEndWorkers

        workers = FrontEndWorkers(engine, server_kwargs)
    try:
        return run_front_end(engine, workers)
    finally:
        if workers is not None:
            workers.close()


def run_front_end(
    engine,
    workers=None,
    sockets: list | None = None,
    metrics_dir: str | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve HTTP for ``engine`` until a signal or the scheduler's failure; the exit status.
    ``workers``: the other front ends, started here (this process started the scheduler);
    ``sockets``: the listening socket, when another process bound it."""
    import uvicorn

    from loom.server.app import create_app

    args = engine.server_args
    failed: list[BaseException] = []
    servers: list = []

    def stop(message: str) -> None:
        print(f"loom serve: {message}; shutting down", file=sys.stderr, flush=True)
        _start_shutdown_timers(engine, workers)
        if workers is not None:
            workers.signal()
        if servers:
            servers[0].should_exit = True
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_failure(error: BaseException) -> None:
        # The survivor exits with a clear message and status 1, by the same sequence as on
        # SIGTERM (called on the engine's receiving thread; uvicorn polls should_exit).
        failed.append(error)
        stop(str(error))

    engine.on_failure_hooks.append(on_failure)
    if workers is not None:
        metrics_dir = workers.metrics_dir
    app = create_app(engine, metrics_dir=metrics_dir, on_ready=on_ready)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=DRAIN_S + 1.0,
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:  # (Ctrl-C reaches every front end, and this one passes it on)
                return
            _start_shutdown_timers(engine, workers)
            if workers is not None:
                workers.signal()
            super().handle_exit(sig, frame)

    server = Server(config)
    servers.append(server)
    if workers is not None:
        from loom.server.workers import listening_socket

        sockets = [listening_socket(args.host, args.port)]  # bound first: a port in use fails

        def worker_exited(index: int, code: int | None) -> None:
            failed.append(RuntimeError(f"front end {index} exited"))
            stop(f"front-end process {index} exited with code {code}")

        workers.start(worker_exited)
        engine.before_shutdown.append(workers.join)
    if engine.info.get("front_end", 0) == 0:
        name = args.served_model_name or args.model
        count = args.tokenizer_worker_num
        print(
            f"Loom is serving {name!r} at http://{args.host}:{args.port} "
            f"(OpenAI API under /v1, metrics at /metrics"
            + (f"; {count} front-end processes" if count > 1 else "")
            + ")",
            flush=True,
        )
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down
        return 130
    finally:
        engine.shutdown()
    return 1 if failed else 0


_timers_started = threading.Event()


def _start_shutdown_timers(engine, workers=None) -> None:
    if _timers_started.is_set():
        return
    _timers_started.set()

    def drain() -> None:
        n = engine.end_all("the server is shutting down")
        if n:
            logger.warning("ended %d running request(s): the server is shutting down", n)

    def deadline() -> None:
        print(
            f"loom serve: shutdown did not complete within {EXIT_DEADLINE_S} s; exiting",
            file=sys.stderr,
            flush=True,
        )
        if workers is not None:
            workers.kill()
        process = getattr(engine.backend, "process", None)
        if process is not None and process.is_alive():
            process.kill()
        os._exit(1)

    for delay, fn in ((DRAIN_S, drain), (EXIT_DEADLINE_S, deadline)):
        timer = threading.Timer(delay, fn)
        timer.daemon = True
        timer.start()
