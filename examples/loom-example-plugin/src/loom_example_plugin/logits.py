"""``example_force_token``: the row's next token is ``custom_params["token_id"]``, always; or,
with ``custom_params["token_ids"]`` (a script), the script's token at the output's position, and
the model's own choice once the script is spent (tests drive whole answers with it: a tool call,
a reasoning block).

This module imports torch (through Loom's interface); ``register`` names it only as a string, so
that cost is paid when a request first uses the processor, not at discovery.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.sampling.logits_processor import LogitsProcessor


class ForceTokenProcessor(LogitsProcessor):
    """Sets every logit of a row to -inf except the one at ``params["token_id"]``.

    The forced logit keeps its value, so log-probabilities stay meaningful for that token. A row
    whose id is missing or outside the vocabulary is left unchanged: ``validate_params`` rejects
    the first case when the request arrives, and the vocabulary size is not known until here.
    """

    example_params = {"token_id": 3}  # used by loom.testing.check_logits_processor

    def validate_params(self, params: dict[str, Any]) -> None:
        script = params.get("token_ids")
        if script is not None:
            if not isinstance(script, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in script
            ):
                raise ValueError(
                    f"example_force_token: token_ids must be a list of ids >= 0, got {script!r}"
                )
            return
        token_id = params.get("token_id")
        # bool is an int subclass, but `true` is not a token id.
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(
                f"example_force_token needs custom_params {{'token_id': int >= 0}}, got {params!r}"
            )

    def __call__(
        self,
        logits: torch.Tensor,
        params_per_row: list[dict[str, Any]],
        token_ids_per_row: list[list[int]],
    ) -> torch.Tensor:
        vocab_size = logits.shape[-1]
        rows: list[int] = []
        ids: list[int] = []
        for row, params in enumerate(params_per_row):
            token_id = params.get("token_id")
            script = params.get("token_ids")
            if script is not None:
                history = token_ids_per_row[row]
                done = len(history) - history.prompt_len
                token_id = script[done] if done < len(script) else None
            if isinstance(token_id, int) and 0 <= token_id < vocab_size:
                rows.append(row)
                ids.append(token_id)
        if not rows:
            return logits
        # Three indexed ops for the whole group of rows, and no device-to-host sync.
        row_idx = torch.tensor(rows, device=logits.device)
        id_idx = torch.tensor(ids, device=logits.device)
        kept = logits[row_idx, id_idx]
        logits[row_idx] = float("-inf")
        logits[row_idx, id_idx] = kept
        return logits
