from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.layers.fused_ops import silu_and_mul, use_fused


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
