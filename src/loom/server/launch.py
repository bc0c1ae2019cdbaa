"""``loom serve``: the front end in this process, the scheduler in a child process."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

logger = logging.getLogger("loom.serve")


def serve(server_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from loom.engine.engine import Engine
    from loom.server.app import create_app

    logging.basicConfig(
        level=server_kwargs.get("log_level", "warning").upper(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    engine = Engine(backend="process", **server_kwargs)
    args = engine.server_args
    failed: list[BaseException] = []

    def on_failure(error: BaseException) -> None:
        # The survivor exits with a clear message: stop uvicorn as on Ctrl-C.
        failed.append(error)
        print(f"loom serve: {error}; shutting down", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    engine.on_failure_hooks.append(on_failure)
    app = create_app(engine)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    name = args.served_model_name or args.model
    print(
        f"Loom is serving {name!r} at http://{args.host}:{args.port} "
        f"(OpenAI API under /v1, metrics at /metrics)",
        flush=True,
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if failed else 0
