"""Conformance kit of the logits_processor family."""

from __future__ import annotations

from typing import Any

import torch

from loom.testing._common import instantiate


def check_logits_processor(
    name: str, params: dict[str, Any] | None = None, vocab_size: int = 64, seed: int = 0
) -> None:
    """Shape and dtype are kept, ``validate_params`` accepts ``params`` (default: the
    processor's ``example_params``), and rows are processed independently (a row's result does
    not depend on which other rows share the call)."""
    proc = instantiate("logits_processor", name)
    if params is None:
        params = dict(getattr(proc, "example_params", {}))
    proc.validate_params(params)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, vocab_size, generator=gen)
    history = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    together = proc(logits.clone(), [params] * 4, history)
    assert together.shape == logits.shape and together.dtype == logits.dtype, (
        f"{name}: must return logits of the same shape and dtype"
    )
    for i in range(4):
        alone = proc(logits[i : i + 1].clone(), [params], [history[i]])
        assert torch.equal(alone[0], together[i]), f"{name}: rows must be independent"
