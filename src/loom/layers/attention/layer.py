from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from loom.forward_batch import ForwardBatch


class Attention(nn.Module):
    """An attention layer of a model; the math is delegated to the batch's attention backend."""

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

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
