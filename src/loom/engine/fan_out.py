"""The one fan-out of a call into requests: each prompt of a batch (or the one prompt) times its
``n``, every one validated before any is submitted. ``Engine.generate``, ``async_generate`` and
the HTTP routes (through ``async_generate``) all go through it.

``prepare(prompt, input_ids, sampling_params)`` validates one prompt (``validation.py``) and
returns its ids and ``SamplingParams``; ``check_lora(name)`` refuses an unknown adapter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from loom.engine.validation import check_options, logprob_options
from loom.sampling.limits import ParamError
from loom.sampling.sampling_params import SamplingParams

# return_logprob, top_logprobs_num, logprob_start_len: one value for every prompt, or a list;
# token_ids_logprob: a list of ids for every prompt, or a list of such lists (SGLang's forms)
LOGPROB_OPTIONS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob")
NO_LOGPROBS = (False, 0, -1, None)


def fan_out(
    prepare,
    check_lora,
    prompt,
    input_ids,
    sampling_params,
    rid,
    priority,
    extra_key,
    lora_path,
    custom_logit_processor=None,
    logprob=NO_LOGPROBS,
    vocab_size: int | None = None,
) -> tuple[list[tuple], bool]:
    """Every request one call asks for, all validated before any is submitted: each prompt
    of a batch (or the one prompt) times its ``n``. Sample ``i`` of ``n`` is request
    ``{rid}-{i}`` with seed + i when seeded; the scheduler prefills a shared prompt once
    (identical prompts admitted together wait one step for the first one's KV).
    ``custom_logit_processor`` (SGLang's top-level argument, one or one per prompt) goes into
    each prompt's sampling parameters; ``logprob`` is ``LOGPROB_OPTIONS``' values, each for
    every prompt or one per prompt (ids checked against ``vocab_size``). Returns the (ids, params, rid,
    priority, extra_key, lora, logprob) rows and whether the call asked for more than one
    request (its results are then a list)."""
    batch = _as_batch(prepare, prompt, input_ids, sampling_params, rid, custom_logit_processor)
    if batch is None:
        if isinstance(custom_logit_processor, list):
            raise ParamError(
                "custom_logit_processor", "custom_logit_processor: a list needs a batch of prompts"
            )
        sp = with_processor(sampling_params, custom_logit_processor)
        rows = [(*prepare(prompt, input_ids, sp), rid)]
        per = [(priority, extra_key, lora_path, *logprob)]
    else:
        n = len(batch)
        *scalars, ids = logprob
        lists = [
            v if isinstance(v, list) else [v] * n
            for v in (priority, extra_key, lora_path, *scalars)
        ]
        nested = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        lists.append(ids if nested else [ids] * n)
        names = ("priority", "extra_key", "lora_path", *LOGPROB_OPTIONS)
        for name, v in zip(names, lists, strict=True):
            if len(v) != n:
                raise ParamError(name, f"{name}: a list of {len(v)} for {n} prompts")
        rows, per = batch, list(zip(*lists, strict=True))
    checked = []
    for pr, k, lo, *lp in per:
        check_options(pr, k)
        check_lora(lo)
        checked.append((pr, k, lo, logprob_options(*lp, vocab_size=vocab_size)))
    out = []
    for (ids, params, r), (pr, k, lo, lp) in zip(rows, checked, strict=True):
        for i in range(params.n):
            p, ri = params, r
            if params.n > 1:
                p = dataclasses.replace(params, n=1)
                if p.sampling_seed is not None:
                    p.sampling_seed = p.sampling_seed + i
                ri = f"{r}-{i}" if r else None
            out.append((ids, p, ri, pr, k, lo, lp))
    return out, batch is not None or len(out) > 1


def fan_out_call(prepare, check_lora, args: dict[str, Any], vocab_size: int | None):
    """``fan_out`` over ``Engine.generate``'s (or ``async_generate``'s) arguments by name."""
    keys = ("prompt", "input_ids", "sampling_params", "rid", "priority", "extra_key", "lora_path")
    return fan_out(
        prepare,
        check_lora,
        *(args[k] for k in keys),
        args["custom_logit_processor"],
        tuple(args[k] for k in LOGPROB_OPTIONS),
        vocab_size=vocab_size,
    )


def with_processor(sampling_params: Any, processor: Any) -> Any:
    """``sampling_params`` with ``custom_logit_processor`` set (SGLang takes it beside the
    sampling parameters; Loom also takes it among them, and refuses two different ones)."""
    if processor is None:
        return sampling_params
    if isinstance(sampling_params, SamplingParams):
        given = sampling_params.custom_logit_processor
    elif sampling_params is None or isinstance(sampling_params, dict):
        given = (sampling_params or {}).get("custom_logit_processor")
    else:
        return sampling_params  # (refused by SamplingParams.from_dict)
    if given is not None and given != processor:
        raise ParamError(
            "custom_logit_processor",
            "custom_logit_processor is given both beside sampling_params and in it, differently",
        )
    if isinstance(sampling_params, SamplingParams):
        return dataclasses.replace(sampling_params, custom_logit_processor=processor)
    return {**(sampling_params or {}), "custom_logit_processor": processor}


def _as_batch(prepare, prompt, input_ids, sampling_params, rid, processor):
    """Validate every item of a batch before submitting any; None for a single request."""
    if isinstance(prompt, list):
        items = [(p, None) for p in prompt]
    elif input_ids is not None and input_ids and isinstance(input_ids[0], list):
        items = [(None, ids) for ids in input_ids]
    else:
        return None
    n = len(items)
    params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
    rids = (
        rid if isinstance(rid, list) else [None if rid is None else f"{rid}_{i}" for i in range(n)]
    )
    procs = processor if isinstance(processor, list) else [processor] * n
    if len(params_list) != n or len(rids) != n or len(procs) != n:
        raise ValueError(
            "sampling_params, rid and custom_logit_processor lists must match the number of prompts"
        )
    out = []
    for (p, ids), sp, r, proc in zip(items, params_list, rids, procs, strict=True):
        tokens, params = prepare(p, ids, with_processor(sp, proc))
        out.append((tokens, params, r))
    return out
