"""A request's state on the front end, and what turns the scheduler's outputs into what the
caller gets: incremental detokenising, stop strings and ``stop_regex`` patterns, logprobs with
their texts, the final result.

The text leaves out what stopped the request, as SGLang's and vLLM's do: a stop string, the
match of a ``stop_regex`` pattern, or the stop token (one of ``stop_token_ids``, EOS) that ended
it; ``no_stop_trim`` keeps it. ``output_ids`` keep the stop token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loom.engine.profile import FrontendProfile
from loom.engine.tokenizer_manager import IncrementalDetokenizer
from loom.sampling.sampling_params import SamplingParams
from loom.sampling.stop_regex import compile_stop_regex
from loom.scheduler.messages import GenerateRequest, ReqOutput

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    params: SamplingParams
    outputs: queue.Queue | asyncio.Queue
    loop: asyncio.AbstractEventLoop | None = None
    detok: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    start: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None  # stamped on the backend's thread
    last_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # the detokenised text so far (cut at a stop string)
    emitted: int = 0  # characters of ``text`` already handed to the caller
    regex_checked: int = 0  # characters of ``text`` known to hold no stop_regex match
    logprobs: dict[str, list] | None = None  # return_logprob: accumulated meta_info lists
    logprob_text: bool = True  # logprob entries carry their token's text (else None)
    prompt_ids: list[int] | None = None  # return_prompt_token_ids: in every result
    lora_id: str | None = None  # the adapter reference it runs on (counted in the registry)
    # the queue is a batch's (``wait_all``): a step's outputs for it arrive as one list
    shared: bool = False

    def expect_logprobs(self, req: GenerateRequest) -> None:
        """The lists of ``meta_info`` that ``req``'s logprob options fill."""
        if not req.return_logprob:
            return
        self.logprobs = {"output_token_logprobs": [], "output_top_logprobs": []}
        if req.logprob_start_len >= 0:
            self.logprobs["input_token_logprobs"] = []
            if req.top_logprobs_num:
                self.logprobs["input_top_logprobs"] = []
        if req.token_ids_logprob:
            self.logprobs["output_token_ids_logprobs"] = []
            self.logprobs["input_token_ids_logprobs"] = []


def apply_output(
    st: ReqState,
    out: ReqOutput,
    tokenizer: Any,
    abort: Callable[[str], None],
    profile: FrontendProfile | None = None,
) -> dict[str, Any]:
    """Apply one scheduler output to the request's state: extend its ids, detokenise (without
    the stop token that ended it), cut at the earliest stop string or ``stop_regex`` match
    (``abort``-ing the request if the scheduler had not finished it), accumulate logprobs with
    their texts; returns the increment as an SGLang dict. Streams get only text that cannot
    turn out to be part of a stop."""
    new_ids = list(out.new_token_ids)
    st.output_ids.extend(new_ids)
    finished = out.finished_reason
    delta = ""
    if st.detok is not None:
        t = time.perf_counter()
        text_ids = new_ids[:-1] if _trims_stop_token(finished, st.params, new_ids) else new_ids
        added = st.detok.add(text_ids, final=finished is not None)
        if profile is not None:
            profile.detokenize_s += time.perf_counter() - t
            profile.detokenized_tokens += len(new_ids)
        st.text += added
        p = st.params
        hit = _find_stop(st, len(added)) if added and (p.stop or p.stop_regex) else None
        if hit is not None:
            matched, start, end = hit
            st.text = st.text[: end if p.no_stop_trim else start]
            if finished is None or finished.get("type") != "stop":
                finished = {"type": "stop", "matched": matched}
            if out.finished_reason is None:
                abort(st.rid)
        # Stream only text that cannot turn out to be the start of a stop.
        text = st.text
        end = len(text) if finished is not None else len(text) - _held_back(st)
        delta, st.emitted = text[st.emitted : end], max(st.emitted, end)
    if finished is not None:
        st.finished = True
    meta = {
        "id": st.rid,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": len(st.output_ids),
        "cached_tokens": out.cached_tokens,
        "finish_reason": finished,
        "e2e_latency": (st.finish_time or time.monotonic()) - st.start,
        "ttft": (st.first_token_time or st.finish_time or time.monotonic()) - st.start,
    }
    if out.error:
        meta["error"] = out.error
    if st.logprobs is not None:
        tok = tokenizer if st.logprob_text else None
        for key, entries in out.extra.items():
            if key in st.logprobs:
                st.logprobs[key] += _with_text(tok, key, entries)
        n_new = len(out.extra.get("output_token_logprobs", []))
        for key, acc in st.logprobs.items():
            meta[key] = acc if key in _WHOLE_PROMPT else acc[len(acc) - n_new :]
    inc = {"text": delta, "output_ids": new_ids, "meta_info": meta}
    if st.prompt_ids is not None:
        inc["prompt_token_ids"] = st.prompt_ids
    return inc


def merge_increments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive increments of one request as one (``b``'s meta_info, with the
    per-token logprob lists of both)."""
    meta = dict(b["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        if key in meta:
            meta[key] = a["meta_info"].get(key, []) + meta[key]
    return {
        **b,
        "text": a["text"] + b["text"],
        "output_ids": a["output_ids"] + b["output_ids"],
        "meta_info": meta,
    }


class OutputConsumer:
    """Applies a request's outputs to its state on the caller's side (``consumer(st, outs)``:
    its pending outputs as one; ``consumer.one(st, out)``) and forgets a finished request."""

    def __init__(
        self,
        tokenizer: Any,
        abort: Callable[[str], None],
        forget: Callable[[str], None],
        profile: FrontendProfile,
    ) -> None:
        self.tokenizer, self.abort, self.forget, self.profile = tokenizer, abort, forget, profile

    def __call__(self, st: ReqState, outs: list[ReqOutput]) -> dict[str, Any]:
        """A caller that fell behind detokenises once for all its pending outputs, up to the
        one that finishes the request (an engine failure's abort may queue after it)."""
        for k, out in enumerate(outs):
            if out.finished_reason is not None:
                outs = outs[: k + 1]
                break
        return self.one(st, merge_outputs(outs))

    def one(self, st: ReqState, out: ReqOutput) -> dict[str, Any]:
        """Apply one output; returns the increment. A failure here (detokenising, a stop-string
        check) fails this request alone: it is aborted in the scheduler and its increment
        carries the error."""
        t = time.perf_counter()
        try:
            return self._apply(st, out)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            logger.exception("request %s failed in the front end", st.rid)
            message = f"the front end failed on this request: {type(e).__name__}: {e}"
            failed = ReqOutput(
                st.rid,
                [],
                st.prompt_tokens,
                len(st.output_ids),
                finished_reason={"type": "abort", "message": message, "status_code": 500},
                error=message,
            )
            if out.finished_reason is None:
                self.abort(st.rid)
            st.detok = None  # (the text so far is kept; no more decoding)
            return self._apply(st, failed)
        finally:
            self.profile.outputs += 1
            self.profile.apply_s += time.perf_counter() - t

    def _apply(self, st: ReqState, out: ReqOutput) -> dict[str, Any]:
        inc = apply_output(st, out, self.tokenizer, self.abort, self.profile)
        if st.finished:
            self.forget(st.rid)
        return inc


def merge_outputs(outs: list[ReqOutput]) -> ReqOutput:
    """Consecutive outputs of one request as one: the ids and the logprob lists concatenated,
    the rest from the newest (only the last can have finished the request)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    extra: dict[str, list] = {}
    for out in outs:
        for key, entries in out.extra.items():
            extra.setdefault(key, []).extend(entries)
    return ReqOutput(
        last.rid,
        [i for out in outs for i in out.new_token_ids],
        last.prompt_tokens,
        last.completion_tokens,
        last.cached_tokens,
        last.finished_reason,
        last.error,
        extra,
    )


# logprob lists of the prompt: sent whole, once, with the prompt's last chunk
_WHOLE_PROMPT = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
# lists of entries per position (a position with none is None)
_ROWS = (
    "output_top_logprobs",
    "input_top_logprobs",
    "output_token_ids_logprobs",
    "input_token_ids_logprobs",
)


def _with_text(tokenizer: Any, key: str, entries: list) -> list:
    """(logprob, id) -> (logprob, id, text) as SGLang returns them."""
    tok = tokenizer

    def text(i: int) -> str | None:
        return tok.decode([i]) if tok is not None else None

    if key in _ROWS:
        return [None if row is None else [(lp, i, text(i)) for lp, i in row] for row in entries]
    return [(lp, i, text(i)) for lp, i in entries]


def _trims_stop_token(finished: dict | None, params: SamplingParams, new_ids: list[int]) -> bool:
    """Whether the last new id is the stop token that finished the request, left out of the
    text (SGLang's and vLLM's rule; not with ``no_stop_trim``)."""
    if not finished or finished.get("type") != "stop" or params.no_stop_trim or not new_ids:
        return False
    matched = finished.get("matched")
    return type(matched) is int and new_ids[-1] == matched


def _find_stop(st: ReqState, new_chars: int) -> tuple[str, int, int] | None:
    """(what matched, start, end) of the stop that the newest ``new_chars`` characters
    completed first (the smallest end): a stop string, or a ``stop_regex`` pattern's match.
    Only the text's tail is searched for stop strings, so a long output costs no quadratic
    rescans; a pattern's search is bounded as ``sampling/stop_regex.py`` says."""
    text = st.text
    best = None  # (end, start, matched)
    for s in st.params.stop:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i != -1 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    for pattern in st.params.stop_regex:
        span = compile_stop_regex(pattern).first_match(text, st.regex_checked)
        if span is not None and (best is None or (span[1], span[0]) < best[:2]):
            best = (span[1], span[0], pattern)
    st.regex_checked = len(text)
    return None if best is None else (best[2], best[1], best[0])


def _held_back(st: ReqState) -> int:
    """How many characters at the end of the text could still turn out to be part of a stop:
    the longest suffix that is a proper prefix of a stop string, or the text from where a
    ``stop_regex`` pattern could begin to match."""
    text = st.text
    held = _partial_stop(text, st.params.stop)
    for pattern in st.params.stop_regex:
        start = compile_stop_regex(pattern).partial_start(text, st.regex_checked)
        if start is not None:
            held = max(held, len(text) - start)
    return held


def final_result(st: ReqState, last: dict[str, Any]) -> dict[str, Any]:
    """The whole result of a finished request, from its state and its last increment."""
    text = st.text
    meta = dict(last["meta_info"])
    if st.logprobs is not None:
        meta.update({k: list(v) for k, v in st.logprobs.items()})
    result = {"text": text, "output_ids": list(st.output_ids), "meta_info": meta}
    if st.prompt_ids is not None:
        result["prompt_token_ids"] = st.prompt_ids
    return result


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def wait_all(states: list[ReqState], shared, consume) -> list[dict[str, Any]]:
    """The results of requests whose outputs arrive on one ``shared`` queue, consumed in
    arrival order whichever request they belong to: each output is detokenised and checked for
    stop strings as it comes (``consume(st, out)``; a request that hit one is aborted at once,
    not when the caller gets to it), and nothing piles up behind the request waited for."""
    index = {st.rid: i for i, st in enumerate(states)}
    results: list[dict[str, Any] | None] = [None] * len(states)
    left = len(states)
    while left:
        got = shared.get()  # a step's outputs (a list), or one (an engine failure's abort)
        for out in got if isinstance(got, list) else [got]:
            i = index[out.rid]
            st = states[i]
            if st.finished:  # (an engine failure's abort after the request's end)
                continue
            inc = consume(st, out)
            if st.finished:
                results[i] = final_result(st, inc)
                left -= 1
    return results
