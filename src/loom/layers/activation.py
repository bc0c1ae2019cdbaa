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


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU); ``approximate="tanh"`` is HF's
    ``gelu_pytorch_tanh`` (Gemma)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


# HF ``hidden_act`` / ``hidden_activation`` names of gated MLPs' activations
_GATED = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    "gelu_new": lambda: GeluAndMul("tanh"),
    "gelu_fast": lambda: GeluAndMul("tanh"),
}


def gated_activation(name: str) -> nn.Module:
    """The ``act(gate) * up`` module for an HF activation name."""
    if name not in _GATED:
        raise ValueError(f"unsupported MLP activation {name!r} (supported: {sorted(_GATED)})")
    return _GATED[name]()
