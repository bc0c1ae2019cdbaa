"""The logits_processor family: named processors installed on the server.

A request names a processor (``custom_logit_processor``) and passes JSON parameters
(``custom_params``): nothing a client sends is unpickled or executed. The sampler groups the
rows of a batch by processor name and calls each processor once per step with just its rows.
(SGLang's client-sent processors, refused unless the server is started with
``--enable-custom-logit-processor``, are ``sglang_processor.py``.)
"""

from __future__ import annotations

from typing import Any

import torch

from loom.sampling.base import LogitsProcessor, TokenHistory
from loom.sampling.limits import INT32_MAX

__all__ = ["LogitsProcessor", "TokenHistory"]


class DisallowedTokensProcessor(LogitsProcessor):
    """Never sample the token ids in ``params["token_ids"]``."""

    example_params = {"token_ids": [1, 2, 3]}

    def validate_params(self, params: dict[str, Any]) -> None:
        ids = params.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError("disallowed_tokens needs custom_params {'token_ids': [int, ...]}")

    def __call__(self, logits, params_per_row, token_ids_per_row):
        vocab = logits.shape[-1]
        for row, params in enumerate(params_per_row):
            ids = [i for i in params.get("token_ids", []) if 0 <= i < vocab]
            if ids:
                logits[row, ids] = float("-inf")
        return logits


def _force(row: torch.Tensor, token: int) -> None:
    keep = row[token].clone()
    row.fill_(float("-inf"))
    row[token] = keep if torch.isfinite(keep) else 0.0


class ThinkingBudgetProcessor(LogitsProcessor):
    """Ends thinking after a budget: once ``budget`` tokens have been generated without the
    think-end sequence, forces it (its next id each step). Params: ``{"budget": N,
    "think_end_ids": [ids]}``, the ids of e.g. ``</think>`` in the model's tokenizer."""

    example_params = {"budget": 2, "think_end_ids": [5, 6]}

    def validate_params(self, params):
        b, ids = params.get("budget"), params.get("think_end_ids")
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError("thinking_budget needs custom_params budget: an integer >= 0")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT32_MAX for i in ids
            )
        ):
            raise ValueError("thinking_budget needs custom_params think_end_ids: [token ids]")

    def __call__(self, logits, params_per_row, token_ids_per_row):
        for row, (params, hist) in enumerate(zip(params_per_row, token_ids_per_row, strict=True)):
            out = list(hist[getattr(hist, "prompt_len", 0) :])
            end, budget = params["think_end_ids"], params["budget"]
            if _contains(out, end):
                continue
            # how much of the end sequence the output already ends with (forcing in progress)
            done = next((k for k in range(len(end) - 1, 0, -1) if out[-k:] == end[:k]), 0)
            if len(out) - done >= budget and end[done] < logits.shape[-1]:
                _force(logits[row], end[done])
        return logits


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


class NoRepeatNGramProcessor(LogitsProcessor):
    """Bans tokens that would repeat an n-gram of the history (prompt and output), as HF's
    ``NoRepeatNGramLogitsProcessor``. Params: ``{"n": N}``."""

    example_params = {"n": 2}

    def validate_params(self, params):
        n = params.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError("no_repeat_ngram needs custom_params n: an integer >= 1")

    def __call__(self, logits, params_per_row, token_ids_per_row):
        for row, (params, hist) in enumerate(zip(params_per_row, token_ids_per_row, strict=True)):
            n = params["n"]
            if len(hist) + 1 < n:
                continue
            prefix = tuple(hist[len(hist) - n + 1 :]) if n > 1 else ()
            banned = {
                hist[i + n - 1]
                for i in range(len(hist) - n + 1)
                if tuple(hist[i : i + n - 1]) == prefix
            }
            if banned:
                logits[row, sorted(banned)] = float("-inf")
        return logits
