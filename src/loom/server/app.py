"""The HTTP server: OpenAI-compatible routes under /v1 (``openai_routes``), SGLang's native
routes and /metrics (``native_routes``).

The app holds the front end (an ``Engine`` whose scheduler runs in its own process); handlers only
tokenise, submit, and stream increments back, so one slow or bad request never blocks others.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from loom.server import chat_routes, native_routes, openai_routes
from loom.server.context import ServerContext
from loom.server.errors import APIKeyMiddleware, install_error_handlers

if TYPE_CHECKING:
    from loom.engine.engine import Engine


def create_app(
    engine: Engine, metrics_dir: str | None = None, on_ready: Callable[[], None] | None = None
) -> FastAPI:
    """``metrics_dir``: prometheus_client's multiprocess directory, shared by every front-end
    process of the server; ``on_ready`` is called once the app serves."""
    ctx = ServerContext(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        loop = asyncio.get_running_loop()
        # the scheduler's outputs are received on this loop, which streams them
        engine.backend.receive_on(loop)
        # What start-up built (the tokenizer, imported libraries, the app) lives until shutdown:
        # keep it out of the collector's full passes, each of which would otherwise walk it all
        # while every stream waits.
        gc.collect()
        gc.freeze()
        if on_ready is not None:
            on_ready()
        yield
        engine.backend.stop_receiving()
        # Stop the scheduler process before uvicorn re-raises SIGTERM/SIGINT and exits.
        await loop.run_in_executor(None, engine.shutdown)

    app = FastAPI(title="Loom", version="0.1.0", lifespan=lifespan)
    if not ctx.args.disable_metrics:
        from loom.server.metrics import Metrics

        ctx.metrics = engine.metrics = Metrics(ctx.model_name, metrics_dir)
    install_error_handlers(app)
    if ctx.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.args.api_key)
    app.include_router(chat_routes.router(ctx))
    app.include_router(openai_routes.router(ctx))
    app.include_router(native_routes.router(ctx))
    return app
