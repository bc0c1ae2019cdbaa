from __future__ import annotations

import torch
from torch import nn

from loom.layers.fused_ops import add_rmsnorm, use_fused


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: ``forward(x, residual)`` returns
    ``(norm(x + residual), x + residual)``, so decoder layers carry the residual stream."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def kernel_weight(self) -> torch.Tensor:
        """The weight the fused kernels multiply by."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_fused(x):
            return add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the norm scales by ``1 + w``, multiplied
    in fp32 before rounding (Llama's rounds the normalised value first). The fused CUDA kernel
    takes ``1 + w`` in the model's dtype, so on GPUs the two roundings may differ by an ulp."""

    def process_weights_after_loading(self) -> None:
        scale = (1.0 + self.weight.detach().float()).to(self.weight.dtype)
        current = getattr(self, "_scale", None)
        if current is not None and current.shape == scale.shape:
            current.copy_(scale)  # in place: captured CUDA graphs read this tensor
        else:
            self._scale = scale

    def kernel_weight(self) -> torch.Tensor:
        scale = getattr(self, "_scale", None)
        if scale is None:
            scale = (1.0 + self.weight.float()).to(self.weight.dtype)
        return scale

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if use_fused(x):
            return add_rmsnorm(x, residual, self.kernel_weight(), self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
