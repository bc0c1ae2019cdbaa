"""OpenAI's routes: ``/v1/models`` and ``/v1/completions`` (chat completions: ``chat_routes``),
and the response pieces both completions routes share."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request

from loom.server.context import ServerContext
from loom.server.errors import APIError
from loom.server.protocol import (
    finish_reason,
    output_error,
    parse_completion,
)
from loom.server.schemas import CompletionRequest, openapi
from loom.server.streaming import chained, collect, first_of, stream_response


def _decode(engine, ids: list[int]) -> str:
    tok = engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


def _mean_logprob(r: dict[str, Any]) -> float:
    lps = [lp for lp, _, _ in r["logprobs"] if lp is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


def chat_logprobs(entries: list, tops: list) -> dict[str, Any]:
    """OpenAI chat ``logprobs`` from Loom's (logprob, id, text) entries."""

    def one(lp, text):
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for k, (lp, _, text) in enumerate(entries):
        item = one(lp, text)
        item["top_logprobs"] = [
            one(t_lp, t_text) for t_lp, _, t_text in (tops[k] if k < len(tops) else [])
        ]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: list, tops: list) -> dict[str, Any]:
    """OpenAI (legacy) completions ``logprobs``: tokens, token_logprobs, top_logprobs."""
    tokens = [text or "" for _, _, text in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        # (the prompt's first token has neither a logprob nor top entries: null, as OpenAI's)
        "top_logprobs": [
            None
            if entries[k][0] is None
            else {(t_text or ""): t_lp for t_lp, _, t_text in (tops[k] if k < len(tops) else [])}
            for k in range(len(entries))
        ],
        "text_offset": offsets,
    }


def usage(metas: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """OpenAI usage from each stream's last meta_info; streams are prompt-major with ``n``
    choices per prompt, and a prompt is counted once however many choices it has."""
    completion = sum(m.get("completion_tokens", 0) for m in metas)
    prompt = sum(m.get("prompt_tokens", 0) for m in metas[::n])
    cached = sum(m.get("cached_tokens", 0) for m in metas[::n])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    sse = ctx.sse
    engine, args, model_name = ctx.engine, ctx.args, ctx.model_name
    body_of, check_model, admit, start = ctx.body, ctx.check_model, ctx.admit, ctx.start
    adapters = ctx.adapters

    @router.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "loom",
                    "root": args.model,
                    "max_model_len": engine.context_len,
                },
                *(
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "loom",
                        "root": name,
                        "parent": model_name,
                        "max_model_len": engine.context_len,
                    }
                    for name in adapters()
                ),
            ],
        }

    @router.post("/v1/completions", openapi_extra=openapi(CompletionRequest))
    async def completions(request: Request):
        req, prompts = parse_completion(await body_of(request))
        check_model(req)
        k = req.best_of  # samples per prompt (>= n); the n best by mean logprob are returned
        admit(k * len(prompts))
        echo_lp = req.echo and req.logprobs
        streams, prompt_texts = [], []
        for p in prompts:
            text, ids = (p, None) if isinstance(p, str) else (None, p)
            prompt_texts.append(text if text is not None else _decode(engine, ids))
            try:
                streams += await start(
                    ids,
                    text,
                    req.sampling,
                    req,
                    logprobs=req.logprobs or k > req.n,
                    logprob_start_len=0 if echo_lp else -1,
                    n=k,
                )
            except APIError:
                for s in streams:  # the prompts before this one were submitted: abort them
                    await s.aclose()
                raise
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": model_name}

        def choice_logprobs(r: dict[str, Any]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            entries, tops = r["logprobs"], r["top"]
            if echo_lp:
                meta = r["meta_info"]
                prompt_lps = meta.get("input_token_logprobs", [])
                prompt_tops = meta.get("input_top_logprobs") or [[] for _ in prompt_lps]
                entries, tops = prompt_lps + entries, prompt_tops + tops
            return completion_logprobs(entries, tops)

        if not req.stream:
            results = await collect(request, streams)
            chosen = []
            for j in range(len(prompts)):
                group = results[j * k : (j + 1) * k]
                if k > req.n:
                    group = sorted(group, key=_mean_logprob, reverse=True)[: req.n]
                chosen += [(j, r) for r in group]
            return {
                **base,
                "object": "text_completion",
                "choices": [
                    {
                        "index": i,
                        "text": (prompt_texts[j] if req.echo else "") + r["text"],
                        "logprobs": choice_logprobs(r),
                        "finish_reason": finish_reason(r["meta_info"].get("finish_reason")),
                    }
                    for i, (j, r) in enumerate(chosen)
                ],
                "usage": usage([r["meta_info"] for r in results], k),
            }

        first, rest = await first_of(request, streams)

        async def events():
            chunk = {**base, "object": "text_completion"}
            metas: list[dict[str, Any]] = [{} for _ in streams]
            echoed: set[int] = set()
            async for i, inc in chained(first, rest):
                if req.echo and i not in echoed:
                    echoed.add(i)
                    head = {"text": prompt_texts[i // k], "logprobs": None, "finish_reason": None}
                    if echo_lp:
                        head["logprobs"] = completion_logprobs(
                            inc["meta_info"].get("input_token_logprobs", []),
                            inc["meta_info"].get("input_top_logprobs", []),
                        )
                    yield sse({**chunk, "choices": [{"index": i, **head}]})
                meta = metas[i] = inc["meta_info"]
                reason = finish_reason(inc["meta_info"].get("finish_reason"))
                lp = None
                if req.logprobs:
                    lp = completion_logprobs(
                        meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", [])
                    )
                if inc["text"] or reason is not None or (lp and lp["tokens"]):
                    yield sse(
                        {
                            **chunk,
                            "choices": [
                                {
                                    "index": i,
                                    "text": inc["text"],
                                    "logprobs": lp,
                                    "finish_reason": reason,
                                }
                            ],
                        }
                    )
                if (err := output_error(meta)) is not None:
                    yield sse(err.body())
            if req.include_usage:
                yield sse({**chunk, "choices": [], "usage": usage(metas, req.n)})
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    return router
