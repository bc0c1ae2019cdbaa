from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from loom.forward_batch import ForwardBatch


class Attention(nn.Module):
    """An attention layer of a model; the math is delegated to the batch's attention backend.

    ``sliding_window``: a query at position i sees the keys at positions j with
    ``i - sliding_window < j <= i`` (HF transformers' meaning: the window counts the query's own
    token); None or 0: every earlier key. ``logit_cap``: scores are soft-capped to
    ``cap * tanh(score / cap)`` (after scaling, before the mask and softmax); 0: none."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        sliding_window: int | None = None,
        logit_cap: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window or 0
        self.logit_cap = float(logit_cap or 0.0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        batch: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        """``save_kv=False``: the caller already wrote this batch's K/V into the pool (e.g. the
        fused rotary kernel), and ``k``/``v`` may be None."""
        return batch.attn_backend.forward(q, k, v, self, batch, save_kv=save_kv)
