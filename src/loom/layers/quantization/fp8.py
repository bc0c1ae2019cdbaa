"""``--quantization fp8``: linear weights in FP8 E4M3 with one scale per output channel,
quantized when the model loads (from a bf16 / fp32 checkpoint), half the bytes of bf16.

On GPUs with FP8 tensor cores (compute capability 8.9+: Ada, Hopper) the matmul is
``torch._scaled_mm`` on FP8 inputs: each token's activations are scaled to E4M3 by their own
absolute maximum (dynamic per-token scales), the weight by its per-channel scales, accumulated in
fp32 and written in bf16 (the activations' dtype; fp32 activations take the other path). Elsewhere (the CPU, older GPUs) the weight is
dequantized per call and multiplied in the activations' dtype: the same numbers as stored, at
dense speed. Both paths are device tensor work only (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.layers.quantization.base import LinearMethod, QuantizationConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` as FP8 E4M3 and each row's fp32 scale (``w ~ q * scale``)."""
    amax = w.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.squeeze(-1)


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device``."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        pass  # the dense weight receives the checkpoint; it is quantized after loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.data)
        layer.register_buffer("weight_fp8", q, persistent=False)
        layer.register_buffer("weight_scale", scale, persistent=False)
        layer.fp8_matmul = fp8_matmul_supported(q.device)
        del layer.weight
        layer.register_parameter("weight", None)

    def apply(self, layer, x, bias):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # (row-wise scales need bf16 output)
        if layer.fp8_matmul and x.dtype == torch.bfloat16 and x2.shape[0] > 0:
            x_scale = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            y = torch._scaled_mm(
                xq,
                layer.weight_fp8.t(),
                scale_a=x_scale,
                scale_b=layer.weight_scale.unsqueeze(0),
                out_dtype=x.dtype,
            )
            if bias is not None:
                y = y + bias
        else:
            w = layer.weight_fp8.to(x.dtype) * layer.weight_scale.to(x.dtype).unsqueeze(-1)
            y = F.linear(x2, w, bias)
        return y.reshape(*shape[:-1], y.shape[-1])


class Fp8Quantization(QuantizationConfig):
    """Every linear layer (attention and MLP projections) in FP8; embeddings, the LM head,
    norms and MoE experts stay in the model's dtype."""

    name = "fp8"

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any) -> Fp8Quantization:
        qc = getattr(hf_config, "quantization_config", None)
        if qc:
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            raise ValueError(
                f"--quantization fp8 quantizes a bf16 / fp32 checkpoint when it loads; "
                f"{model_path} is already quantized ({method or qc!r})"
            )
        return cls()

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        return Fp8LinearMethod()
