"""SGLang's native routes: ``/generate`` (every field of SGLang's ``GenerateReqInput``, as
``generate_fields.py`` says), health and info, the prefix cache, LoRA adapters, aborts, and
Prometheus ``/metrics``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loom.sampling.limits import show
from loom.server.context import ServerContext
from loom.server.errors import APIError, bad, value_error
from loom.server.generate_fields import refused_field
from loom.server.protocol import output_error
from loom.server.schemas import GenerateBody, fields_of, openapi
from loom.server.streaming import chained, collect, first_of, stream_response

# GenerateReqInput fields that take one value, or one per prompt of a batch, passed to the engine
# under the same names (cache_salt joins extra_key first)
PER_PROMPT = (
    "rid",
    "priority",
    "extra_key",
    "cache_salt",
    "lora_path",
    "custom_logit_processor",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
)
_DEFAULTS = {"return_logprob": False, "top_logprobs_num": 0, "logprob_start_len": -1}


def _per_item(body: dict[str, Any], key: str, n: int) -> list[Any]:
    """``body[key]`` for each of the ``n`` prompts (a list is one per prompt; null is the
    default), or a 400 naming the field."""
    value = body.get(key)
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise bad(f"{key} list must match the batch size ({n})", key)
    return [_DEFAULTS.get(key) if v is None else v for v in values]


def _namespace(extra_key: Any, cache_salt: Any) -> Any:
    """One prefix-cache namespace from SGLang's two fields."""
    for name, value in (("extra_key", extra_key), ("cache_salt", cache_salt)):
        if value is not None and not isinstance(value, str):
            raise bad(f"{name} must be a string, got {show(value)}", name)
    if cache_salt is None or extra_key is None:
        return cache_salt if extra_key is None else extra_key
    return json.dumps([extra_key, cache_salt])


def router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    sse = ctx.sse
    engine, args, model_name, metrics = ctx.engine, ctx.args, ctx.model_name, ctx.metrics
    body_of, admit, adapters = ctx.body, ctx.admit, ctx.adapters
    incremental = args.incremental_streaming_output

    @router.post("/generate", openapi_extra=openapi(GenerateBody))
    async def generate(request: Request):
        body = fields_of(GenerateBody, await body_of(request))
        refused = refused_field(body)
        if refused is not None:
            raise bad(f"{refused[0]} is not supported: {refused[1]}", refused[0])
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise bad("give exactly one of text or input_ids", "text")
        if text is not None:
            batch = isinstance(text, list)
            items = [(t, None) for t in (text if batch else [text])]
        else:
            if not isinstance(input_ids, list):
                raise bad("input_ids must be a list of token ids (or of such lists)", "input_ids")
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            items = [(None, ids) for ids in (input_ids if batch else [input_ids])]
        if not items:
            raise bad("the batch is empty", "text" if text is not None else "input_ids")
        flags = {}
        for key in ("stream", "return_text_in_logprobs", "return_prompt_token_ids"):
            flags[key] = False if body.get(key) is None else body[key]
            if not isinstance(flags[key], bool):
                raise bad(f"{key} must be a boolean", key)
        params = body.get("sampling_params") or {}
        params_list = params if isinstance(params, list) else [params] * len(items)
        if len(params_list) != len(items):
            raise bad("sampling_params list must match the batch size", "sampling_params")
        per_item = {key: _per_item(body, key, len(items)) for key in PER_PROMPT}
        if not all(r is None or isinstance(r, str) for r in per_item["rid"]):
            raise bad("rid must be a string (or a list of strings for a batch)", "rid")
        if isinstance(body.get("rid"), str) and batch:
            per_item["rid"] = [f"{body['rid']}_{i}" for i in range(len(items))]  # (SGLang's)
        per_item["extra_key"] = [
            _namespace(k, salt)
            for k, salt in zip(per_item["extra_key"], per_item.pop("cache_salt"), strict=True)
        ]
        count = 0
        for sp in params_list:
            if not isinstance(sp, dict):
                raise bad("sampling_params must be an object", "sampling_params")
            n = sp.get("n", 1)
            count += n if isinstance(n, int) and not isinstance(n, bool) and 1 < n <= 64 else 1
        admit(count)
        texts = [t for t, _ in items] if text is not None else None
        ids = [i for _, i in items] if text is None else None
        one = not batch  # a single prompt: the engine's arguments take single values
        try:
            out = await engine.async_generate(
                prompt=texts[0] if one and texts else texts,
                input_ids=ids[0] if one and ids else ids,
                sampling_params=params_list[0] if one else params_list,
                stream=True,
                token_ids_logprob=body.get("token_ids_logprob"),
                **{k: v[0] if one else v for k, v in per_item.items()},
                return_text_in_logprobs=flags["return_text_in_logprobs"],
                return_prompt_token_ids=flags["return_prompt_token_ids"],
            )
        except ValueError as e:
            raise value_error(e) from e
        streams = out if isinstance(out, list) else [out]
        batch = isinstance(out, list)  # (n > 1 answers a list too)
        if not flags["stream"]:
            results = await collect(request, streams)
            for r in results:  # (meta_info holds the whole lists)
                del r["logprobs"], r["top"]
            return results if batch else results[0]

        first, rest = await first_of(request, streams)

        async def events():
            acc = [{"text": "", "output_ids": []} for _ in streams]
            async for i, inc in chained(first, rest):
                out = inc  # --incremental-streaming-output: only what is new
                if not incremental:  # SGLang's default: everything so far, in every chunk
                    acc[i]["text"] += inc["text"]
                    acc[i]["output_ids"] += inc["output_ids"]
                    out = {
                        **inc,
                        "text": acc[i]["text"],
                        "output_ids": list(acc[i]["output_ids"]),
                    }
                if batch:
                    out["index"] = i
                yield sse(out)
                if (err := output_error(inc["meta_info"])) is not None:
                    yield sse(err.body())
            yield b"data: [DONE]\n\n"

        return stream_response(events(), rest)

    @router.get("/health")
    async def health():
        if engine._loop_error is not None:
            raise APIError(503, f"the scheduler has failed: {engine._loop_error}")
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate():
        try:
            out = await asyncio.wait_for(
                engine.async_generate(
                    input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
                ),
                60,
            )
        except Exception as e:
            raise APIError(503, f"generation failed: {e}") from e
        if out["meta_info"]["completion_tokens"] != 1:
            raise APIError(503, "generation produced no token")
        return Response(status_code=200)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "served_model_name": model_name,
            "tokenizer_path": args.tokenizer_path or engine.model_path,
            "is_generation": True,
            "architecture": engine.info["architecture"],
            "context_length": engine.context_len,
        }

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info():
        return engine.get_server_info()

    @router.post("/flush_cache")
    async def flush_cache():
        engine.flush_cache()
        return Response(
            "Cache flush requested (done when no request is running).\n", status_code=200
        )

    @router.post("/load_lora_adapter")
    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for key in ("lora_name", "lora_path"):
            if not isinstance(body.get(key), str) or not body[key]:
                raise bad(f"load_lora_adapter needs a non-empty string {key!r}", key)
        pinned = body.get("pinned", False)
        if not isinstance(pinned, bool):
            raise bad("pinned must be true or false", "pinned")
        try:
            await asyncio.to_thread(
                engine.load_lora_adapter, body["lora_name"], body["lora_path"], pinned
            )
        except ValueError as e:
            raise value_error(e) from e
        return {"success": True, "loaded_adapters": adapters()}

    @router.post("/unload_lora_adapter")
    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise bad('unload_lora_adapter needs {"lora_name": "..."}', "lora_name")
        try:
            await asyncio.to_thread(engine.unload_lora_adapter, body["lora_name"])
        except ValueError as e:
            raise value_error(e) from e
        return {"success": True, "loaded_adapters": adapters()}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        """SGLang's body (``model_path``, optional ``load_format`` and ``abort_all_requests``)
        and answer (``success``, ``message``, ``num_paused_requests``; 400 on failure)."""
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise bad('update_weights_from_disk needs {"model_path": "..."}', "model_path")
        load_format = body.get("load_format")
        if load_format is not None and not isinstance(load_format, str):
            raise bad("load_format must be a string", "load_format")
        success, message, paused = await asyncio.to_thread(
            engine.update_weights_from_disk,
            body["model_path"],
            load_format,
            bool(body.get("abort_all_requests", False)),
        )
        answer = {"success": success, "message": message, "num_paused_requests": paused}
        return JSONResponse(answer, status_code=200 if success else 400)

    @router.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request)
        if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
            raise bad('abort_request needs {"rid": "..."}', "rid")
        engine.abort_request(body["rid"])
        return Response(status_code=200)

    if metrics is not None:

        @router.get("/metrics")
        async def metrics_route():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
