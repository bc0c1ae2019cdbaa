"""A sampled token applied to its request (its grammar, stop conditions, logprobs) and the
``ReqOutput`` a step reports for it."""

from __future__ import annotations

from loom.scheduler.messages import ReqOutput
from loom.scheduler.request import Req


def append_token(req: Req, token: int, logprob, eos_token_ids: set[int], context_len: int) -> bool:
    """Append ``token`` and decide whether it ends the request (``finished_reason``): its
    grammar rejects it or terminates, a stop token or EOS, ``max_new_tokens``, or the context.
    ``logprob``: None, or (logprob, [(logprob, id), ...] top entries, [(logprob, id), ...] of
    ``token_ids_logprob``). False: the token was
    dropped, as a request with ``max_new_tokens`` 0 ran only for its prompt's logprobs."""
    p = req.sampling_params
    if p.max_new_tokens == 0:
        req.finished_reason = {"type": "length", "length": 0}
        return False
    req.output_ids.append(token)
    if logprob is not None and req.return_logprob:
        lp, top, chosen = logprob
        req.pending_logprobs.append((lp, token))
        req.pending_top_logprobs.append(top[: req.top_logprobs_num])
        if req.token_ids_logprob:
            req.pending_token_ids_logprobs.append(chosen)
    stop = token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)
    if req.grammar is not None:
        if not req.grammar.accept_token(token):
            req.error = f"the grammar rejected token {token}"
            req.finished_reason = {"type": "abort", "message": req.error}
        elif req.grammar.is_terminated():
            # the grammar's last token is text (a "}"); only a stop token is trimmed from it
            req.finished_reason = {"type": "stop", "matched": token if stop else None}
    if req.is_finished:  # by the grammar
        pass
    elif stop:
        req.finished_reason = {"type": "stop", "matched": token}
    elif len(req.output_ids) >= p.max_new_tokens:
        req.finished_reason = {"type": "length", "length": p.max_new_tokens}
    elif req.seq_len >= context_len:
        req.finished_reason = {"type": "length", "length": len(req.output_ids)}
    if req.finished_reason is not None and req.closed_at is not None:
        req.finished_reason["closed_within_budget_at"] = req.closed_at
    return True


def make_output(req: Req, tokens: list[int]) -> ReqOutput:
    """The request's output for this step: ``tokens`` and the logprobs not yet sent."""
    extra = {}
    if req.return_logprob:
        extra["output_token_logprobs"], req.pending_logprobs = req.pending_logprobs, []
        if req.top_logprobs_num:
            extra["output_top_logprobs"], req.pending_top_logprobs = (
                req.pending_top_logprobs,
                [],
            )
        if req.pending_input_logprobs is not None:
            extra["input_token_logprobs"] = req.pending_input_logprobs
            req.pending_input_logprobs = None
        if req.pending_input_top_logprobs is not None:
            extra["input_top_logprobs"] = req.pending_input_top_logprobs
            req.pending_input_top_logprobs = None
        if req.token_ids_logprob:
            extra["output_token_ids_logprobs"] = req.pending_token_ids_logprobs
            req.pending_token_ids_logprobs = []
        if req.pending_input_token_ids_logprobs is not None:
            extra["input_token_ids_logprobs"] = req.pending_input_token_ids_logprobs
            req.pending_input_token_ids_logprobs = None
    return ReqOutput(
        extra=extra,
        rid=req.rid,
        new_token_ids=tokens,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        finished_reason=req.finished_reason,
        error=req.error,
    )
