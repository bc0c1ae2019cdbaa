"""The logits_processor family: named processors installed on the server.

A request names a processor (``custom_logit_processor``) and passes JSON parameters
(``custom_params``); nothing a client sends is ever unpickled or executed. The sampler groups the
rows of a batch by processor name and calls each processor once per step with just its rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class LogitsProcessor(ABC):
    """Transforms the logits of the rows whose requests named this processor.

    Contract:
    - ``logits`` is a float tensor ``[num_rows, vocab_size]`` (a view into the batch's logits);
      return a tensor of the same shape (modifying in place and returning it is fine).
    - ``params_per_row[i]`` is request i's ``custom_params`` dict (``{}`` if none was given).
    - ``token_ids_per_row[i]`` is request i's history: its prompt ids followed by the ids it has
      generated so far. Do not mutate it.
    - Called once per decode step and once after the prefill; must not block or sync needlessly.
    - ``validate_params`` runs when a request arrives; raise ``ValueError`` naming the problem.
    - ``example_params`` are valid parameters the conformance kit (``loom.testing``) uses.
    """

    example_params: ClassVar[dict[str, Any]] = {}

    @abstractmethod
    def __call__(
        self,
        logits: torch.Tensor,
        params_per_row: list[dict[str, Any]],
        token_ids_per_row: list[list[int]],
    ) -> torch.Tensor: ...

    def validate_params(self, params: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Reject bad per-request parameters with a ValueError."""


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
