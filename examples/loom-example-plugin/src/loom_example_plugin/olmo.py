"""An out-of-tree architecture: OLMo (``OlmoForCausalLM``), which Loom does not ship. It is
Llama with layer norms that have no weight or bias, so it is Loom's shared decoder with another
norm (``DecoderSpec.norm``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.decoder import DecoderForCausalLM, DecoderSpec


class ParameterFreeLayerNorm(nn.Module):
    """OLMo's norm: LayerNorm in fp32 without weight or bias (eps 1e-5, as HF's), with the
    residual-add signature of Loom's norms."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x.float(), self.shape, None, None, eps=1e-5).to(x.dtype)
        return out if residual is None else (out, residual)


class OlmoForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(norm=ParameterFreeLayerNorm)

    def __init__(self, config: Any) -> None:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError("OlmoForCausalLM here does not clip q/k/v (config clip_qkv is set)")
        super().__init__(config)
