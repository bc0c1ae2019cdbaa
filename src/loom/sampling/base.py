"""The interface of the ``logits_processor`` family (``LogitsProcessor``) and the token history
it reads (``TokenHistory``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class TokenHistory(list):
    """A request's prompt + output ids; ``prompt_len`` is where the output starts."""

    prompt_len: int = 0

    @classmethod
    def of(cls, prompt: list[int], output: list[int]) -> TokenHistory:
        h = cls(prompt)
        h.extend(output)
        h.prompt_len = len(prompt)
        return h


class LogitsProcessor(ABC):
    """Transforms the logits of the rows whose requests named this processor.

    Contract:
    - ``logits`` is a float tensor ``[num_rows, vocab_size]`` (a view into the batch's logits);
      return a tensor of the same shape (modifying in place and returning it is fine).
    - ``params_per_row[i]`` is request i's ``custom_params`` dict (``{}`` if none was given).
    - ``token_ids_per_row[i]`` is request i's history: its prompt ids followed by the ids it has
      generated so far, a ``TokenHistory`` (a list whose ``prompt_len`` says where the output
      starts). Do not mutate it.
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
