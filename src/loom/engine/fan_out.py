"""The one fan-out of a call into requests: each prompt of a batch (or the one prompt) times its
``n``, every one validated before any is submitted. ``Engine.generate``, ``async_generate`` and
the HTTP routes (through ``async_generate``) all go through it.

``prepare(prompt, input_ids, sampling_params)`` validates one prompt (``validation.py``) and
returns its ids and ``SamplingParams``; ``check_lora(name)`` refuses an unknown adapter.
"""

from __future__ import annotations

import dataclasses

from loom.engine.validation import check_options


def fan_out(
    prepare, check_lora, prompt, input_ids, sampling_params, rid, priority, extra_key, lora_path
) -> tuple[list[tuple], bool]:
    """Every request one call asks for, all validated before any is submitted: each prompt
    of a batch (or the one prompt) times its ``n``. Sample ``i`` of ``n`` is request
    ``{rid}-{i}`` with seed + i when seeded; the scheduler prefills a shared prompt once
    (identical prompts admitted together wait one step for the first one's KV). Returns
    the (ids, params, rid, priority, extra_key, lora) rows and whether the call asked for
    more than one request (its results are then a list)."""
    batch = _as_batch(prepare, prompt, input_ids, sampling_params, rid)
    if batch is None:
        rows = [(*prepare(prompt, input_ids, sampling_params), rid)]
        per = [(priority, extra_key, lora_path)]
    else:
        n = len(batch)
        lists = [v if isinstance(v, list) else [v] * n for v in (priority, extra_key, lora_path)]
        if any(len(v) != n for v in lists):
            raise ValueError(
                "priority, extra_key and lora_path lists must match the number of prompts"
            )
        rows, per = batch, list(zip(*lists, strict=True))
    for pr, k, lo in per:
        check_options(pr, k)
        check_lora(lo)
    out = []
    for (ids, params, r), (pr, k, lo) in zip(rows, per, strict=True):
        for i in range(params.n):
            p, ri = params, r
            if params.n > 1:
                p = dataclasses.replace(params, n=1)
                if p.sampling_seed is not None:
                    p.sampling_seed = p.sampling_seed + i
                ri = f"{r}-{i}" if r else None
            out.append((ids, p, ri, pr, k, lo))
    return out, batch is not None or len(out) > 1


def _as_batch(prepare, prompt, input_ids, sampling_params, rid):
    """Validate every item of a batch before submitting any; None for a single request."""
    if isinstance(prompt, list):
        items = [(p, None) for p in prompt]
    elif input_ids is not None and input_ids and isinstance(input_ids[0], list):
        items = [(None, ids) for ids in input_ids]
    else:
        return None
    n = len(items)
    params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
    rids = rid if isinstance(rid, list) else [None] * n
    if len(params_list) != n or len(rids) != n:
        raise ValueError("sampling_params and rid lists must match the number of prompts")
    out = []
    for (p, ids), sp, r in zip(items, params_list, rids, strict=True):
        tokens, params = prepare(p, ids, sp)
        out.append((tokens, params, r))
    return out
