"""What every route shares: the engine, the served model's name, and the checks and calls that
sit between a parsed request and the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from loom.server.body import read_json_body
from loom.server.errors import APIError, bad, value_error
from loom.server.protocol import ParsedRequest
from loom.server.streaming import EventEncoder

if TYPE_CHECKING:
    from loom.engine.engine import Engine


class ServerContext:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.args = engine.server_args
        self.model_name = self.args.served_model_name or self.args.model
        self.body_limit = int(self.args.max_request_body_mb * 2**20)
        self.queue_limit = queue_share(
            self.args.max_queued_requests,
            engine.info.get("front_end", 0),
            engine.info.get("front_ends", 1),
        )
        self.metrics = None
        self.sse = EventEncoder(engine.profile)

    async def body(self, request: Request) -> Any:
        return await read_json_body(request, self.body_limit)

    def adapters(self) -> list[str]:
        return sorted(self.engine.lora_names or ())

    def check_model(self, req: ParsedRequest) -> None:
        """The model a request names: the served model, one of its LoRA adapters (``NAME`` or
        ``BASE:NAME``, vLLM's and SGLang's spellings), or a 404. An adapter becomes the
        request's ``lora``; ``lora_path`` may name it too, but not a different one."""
        name = req.model
        if name is None or name in (self.model_name, self.args.model):
            return
        base, sep, adapter = name.partition(":")
        if not sep or base not in (self.model_name, self.args.model):
            adapter = name
        if adapter not in self.adapters():
            known = ", ".join(repr(n) for n in [self.model_name, *self.adapters()])
            why = f"this server serves {known}"
            if sep and adapter != name and self.engine.lora_names is None:
                why = (
                    f"LoRA adapter {adapter!r} requested, but {why} and no adapters (--lora-paths)"
                )
            raise APIError(404, f"model {name!r} not found; {why}", "model", code="model_not_found")
        if req.lora is not None and req.lora != adapter:
            raise bad(f"model names adapter {adapter!r} but lora_path is {req.lora!r}", "model")
        req.lora = adapter

    def admit(self, count: int) -> None:
        if self.engine._loop_error is not None:
            raise APIError(503, f"the scheduler has failed: {self.engine._loop_error}")
        if self.queue_limit is not None and self.engine.num_waiting + count > self.queue_limit:
            limit = self.args.max_queued_requests
            raise APIError(503, f"too many queued requests (limit {limit}); retry later")

    async def start(
        self,
        input_ids: list[int] | None,
        text: str | None,
        sampling: dict[str, Any],
        req: ParsedRequest | None = None,
        logprobs: bool | None = None,
        logprob_start_len: int = -1,
        n: int = 1,
    ) -> list[AsyncIterator[dict[str, Any]]]:
        """The streams of ``n`` samples of one prompt (the engine's fan-out: one message to the
        scheduler, seeded samples at seed + i)."""
        if logprobs is None:
            logprobs = req.logprobs if req else False
        try:
            out = await self.engine.async_generate(
                prompt=text,
                input_ids=input_ids,
                sampling_params={**sampling, "n": n} if n > 1 else sampling,
                stream=True,
                priority=req.priority if req else None,
                extra_key=req.extra_key if req else None,
                lora_path=req.lora if req else None,
                return_logprob=logprobs,
                top_logprobs_num=req.top_logprobs if req and req.logprobs else 0,
                logprob_start_len=logprob_start_len,
            )
        except ValueError as e:
            raise value_error(e, req.names if req else None) from e
        return out if isinstance(out, list) else [out]


def queue_share(limit: int | None, index: int, front_ends: int) -> int | None:
    """Front end ``index``'s share of ``--max-queued-requests``: the shares add up to the
    limit, so the requests waiting over all front ends never exceed it (each front end counts
    only its own)."""
    if limit is None:
        return None
    return limit // front_ends + (1 if index < limit % front_ends else 0)
