"""A request's state on the front end, and what turns the scheduler's outputs into what the
caller gets: incremental detokenising, stop strings, logprobs with their texts, the final
result."""

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
from loom.scheduler.messages import ReqOutput

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
    logprobs: dict[str, list] | None = None  # return_logprob: accumulated meta_info lists
    # the queue is a batch's (``wait_all``): a step's outputs for it arrive as one list
    shared: bool = False


def apply_output(
    st: ReqState,
    out: ReqOutput,
    tokenizer: Any,
    abort: Callable[[str], None],
    profile: FrontendProfile | None = None,
) -> dict[str, Any]:
    """Apply one scheduler output to the request's state: extend its ids, detokenise, cut at
    the earliest stop string (``abort``-ing the request if the scheduler had not finished it),
    accumulate logprobs with their texts; returns the increment as an SGLang dict. Streams get
    only text that cannot turn out to begin a stop string."""
    new_ids = list(out.new_token_ids)
    st.output_ids.extend(new_ids)
    finished = out.finished_reason
    delta = ""
    if st.detok is not None:
        t = time.perf_counter()
        added = st.detok.add(new_ids, final=finished is not None)
        if profile is not None:
            profile.detokenize_s += time.perf_counter() - t
            profile.detokenized_tokens += len(new_ids)
        st.text += added
        hit = _find_stop(st, len(added)) if added and st.params.stop else None
        if hit is not None:
            stop, cut = hit
            if st.params.no_stop_trim:
                cut += len(stop)
            st.text = st.text[:cut]
            if finished is None or finished.get("type") != "stop":
                finished = {"type": "stop", "matched": stop}
            if out.finished_reason is None:
                abort(st.rid)
        # Stream only text that cannot turn out to be the start of a stop string.
        text = st.text
        end = len(text) if finished is not None else len(text) - _partial_stop(text, st.params.stop)
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
        for key, entries in out.extra.items():
            if key in st.logprobs:
                st.logprobs[key] += _with_text(tokenizer, key, entries)
        n_new = len(out.extra.get("output_token_logprobs", []))
        for key, acc in st.logprobs.items():
            meta[key] = acc if key == "input_token_logprobs" else acc[len(acc) - n_new :]
    return {"text": delta, "output_ids": new_ids, "meta_info": meta}


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


def _with_text(tokenizer: Any, key: str, entries: list) -> list:
    """(logprob, id) -> (logprob, id, text) as SGLang returns them."""
    tok = tokenizer

    def text(i: int) -> str | None:
        return tok.decode([i]) if tok is not None else None

    if key == "output_top_logprobs":
        return [[(lp, i, text(i)) for lp, i in row] for row in entries]
    return [(lp, i, text(i)) for lp, i in entries]


def _find_stop(st: ReqState, new_chars: int) -> tuple[str, int] | None:
    """The earliest stop string that the newest ``new_chars`` characters completed (only
    the text's tail is searched, so a long output costs no quadratic rescans)."""
    text = st.text
    best = None
    for s in st.params.stop:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    return best


def final_result(st: ReqState, last: dict[str, Any]) -> dict[str, Any]:
    """The whole result of a finished request, from its state and its last increment."""
    text = st.text
    meta = dict(last["meta_info"])
    if st.logprobs is not None:
        meta.update({k: list(v) for k, v in st.logprobs.items()})
    return {"text": text, "output_ids": list(st.output_ids), "meta_info": meta}


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
