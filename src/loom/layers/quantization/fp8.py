"""``--quantization fp8``: linear weights in FP8 E4M3 with one scale per output channel, half
the bytes of bf16: quantized when the model loads from a bf16 / fp32 checkpoint, or read from an
FP8 checkpoint (``quantization_config.quant_method`` "fp8", the format AutoFP8 and llm-compressor
write for vLLM and SGLang: E4M3 ``weight`` and a per-tensor fp32 ``weight_scale`` per checkpoint
tensor, and with ``activation_scheme`` "static" an ``input_scale``), which selects this method
by itself. A packed layer's parts (q / k / v, gate / up) keep their own scales as its rows'
scales. Activations are always scaled per token (a static ``input_scale`` is loaded and not
used). Block-wise scales (``weight_block_size``) are refused.

On GPUs with FP8 support (compute capability 8.9+: Ada, Hopper), bf16 / fp16 activations take
one of three Triton / cuBLAS paths by their row count. One row (batch-1 decode): a weight-only
GEMV (``fp8_triton.fp8_gemv``) that streams the E4M3 weights once and multiplies them, scaled
per channel, with the activations as they are, in fp32. 2 to ``SKINNY_MAX_M`` rows:
``fp8_triton.fp8_skinny``, FP8 tensor-core dots of the stored weights with the activations
scaled to E4M3 per row and per block of 64 or 128 columns. More rows of bf16:
``torch._scaled_mm`` on FP8 inputs, each token's activations scaled to E4M3 by their own
absolute maximum (one Triton kernel: ``fp8_triton.quantize_per_token``), accumulated in fp32
and written in bf16 (row-wise scales need bf16 output; fp32 activations, and fp16 past the
skinny kernel, take the next path). Elsewhere (the CPU, older GPUs) the weight is
dequantized per call and multiplied in the activations' dtype: the same numbers as stored, at
dense speed. All paths are device tensor work only (CUDA-graph safe).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.layers.quantization.base import LinearMethod, QuantizationConfig
from loom.layers.quantization.fp8_triton import (
    FP8,
    FP8_MAX,
    SKINNY_MAX_M,
    fp8_gemv,
    fp8_skinny,
    quantize_per_token,
)


def _chunks(w: torch.Tensor):
    """``w``'s rows in chunks of about 1M values, each as an fp32 copy: the fp32 working copy
    of a large weight never exists whole (the layered loader's peak is the final weights plus a
    layer)."""
    step = max(1, (1 << 20) // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        yield start, w[start : start + step].to(torch.float32, copy=True)


def quantize_rows(
    w: torch.Tensor, row_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` as FP8 E4M3 and each row's fp32 scale (``w ~ q * scale``), the
    scale from each row's absolute maximum, or from ``row_amax`` ``[rows]`` when given."""
    w = w.detach()
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start, chunk in _chunks(w):
        n = chunk.shape[0]
        amax = chunk.abs().amax(dim=-1) if row_amax is None else row_amax[start : start + n]
        s = amax.unsqueeze(-1).clamp(min=1e-12) / FP8_MAX
        q[start : start + n] = chunk.div_(s).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        scale[start : start + n] = s.squeeze(-1)
    return q, scale


def _row_amax(layer: nn.Module) -> torch.Tensor | None:
    """A row-parallel layer split over ranks: each output row's absolute maximum over every
    rank's columns, so its scale (and so every FP8 value) is the one tensor parallelism 1 gives.
    None for other layers (their rows are whole on each rank)."""
    if getattr(layer, "tp_size", 1) == 1 or not hasattr(layer, "input_size_per_partition"):
        return None
    from loom.distributed import tp_all_reduce_max

    w = layer.weight.data.detach()
    amax = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for start, chunk in _chunks(w):
        amax[start : start + chunk.shape[0]] = chunk.abs().amax(dim=-1)
    return tp_all_reduce_max(amax)


def _quant_method(hf_config: Any) -> str | None:
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    return (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method")


def fp8_matmul_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device``."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module) -> None:
        pass  # the dense weight receives the checkpoint; it is quantized after loading

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.data, _row_amax(layer))
        layer.register_buffer("weight_fp8", q, persistent=False)
        layer.register_buffer("weight_scale", scale, persistent=False)
        layer.fp8_matmul = fp8_matmul_supported(q.device)
        del layer.weight
        layer.register_parameter("weight", None)

    def apply(self, layer, x, bias):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        half = x.dtype in (torch.bfloat16, torch.float16)
        if layer.fp8_matmul and half and rows == 1:
            y = fp8_gemv(x2, layer.weight_fp8, layer.weight_scale, bias)
        elif layer.fp8_matmul and half and 1 < rows <= SKINNY_MAX_M:
            y = fp8_skinny(x2, layer.weight_fp8, layer.weight_scale, bias)
        elif layer.fp8_matmul and x.dtype == torch.bfloat16 and rows > 0:
            # (row-wise scales need bf16 output)
            xq, x_scale = quantize_per_token(x2)
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


def shard_rows(layer: nn.Module) -> list[tuple[Any, int, int]]:
    """A layer's checkpoint parts as (shard id, first row, rows) in its weight."""
    sizes = getattr(layer, "output_sizes", None)
    if hasattr(layer, "q_size"):  # QKVParallelLinear
        q, kv = layer.q_size, layer.kv_size
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if sizes is not None:  # MergedColumnParallelLinear
        rows, out = [], 0
        for i, size in enumerate(sizes):
            size //= layer.tp_size
            rows.append((i, out, size))
            out += size
        return rows
    return [(None, 0, layer.weight.shape[0])]


class Fp8CheckpointLinearMethod(Fp8LinearMethod):
    """A layer of an FP8 checkpoint: E4M3 rows loaded as they are, one scale per part."""

    def __init__(self, static_input: bool) -> None:
        self.static_input = static_input

    def create_weights(self, layer: nn.Module) -> None:
        device = layer.weight.device
        weight = nn.Parameter(
            torch.empty(layer.weight.shape, dtype=FP8, device=device), requires_grad=False
        )
        weight.weight_loader = layer.weight_loader
        layer.weight = weight
        parts = shard_rows(layer)
        layer.fp8_parts = parts
        names = ["weight_scale"] + (["input_scale"] if self.static_input else [])
        for name in names:
            scale = nn.Parameter(
                torch.ones(len(parts), dtype=torch.float32, device=device), requires_grad=False
            )
            scale.weight_loader = self._scale_loader(parts, name)
            layer.register_parameter(name, scale)

    @staticmethod
    def _scale_loader(parts, name: str):
        ids = [sid for sid, _, _ in parts]

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            if loaded.numel() != 1:
                raise ValueError(
                    f"{name} of {loaded.numel()} values: only per-tensor FP8 checkpoint scales "
                    "are read"
                )
            if shard_id is None:  # one tensor for the whole layer
                param.data.fill_(float(loaded.reshape(())))
            else:
                param.data[ids.index(shard_id)] = loaded.reshape(())

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scales = layer.weight_scale.data
        rows = torch.cat([scales[i].expand(n) for i, (_, _, n) in enumerate(layer.fp8_parts)])
        q = layer.weight.data
        for name in ("weight", "weight_scale", "input_scale"):
            if name in layer._parameters:
                del layer._parameters[name]
        layer.register_parameter("weight", None)
        layer.register_buffer("weight_fp8", q, persistent=False)
        layer.register_buffer("weight_scale", rows.contiguous(), persistent=False)
        layer.fp8_matmul = fp8_matmul_supported(q.device)


class Fp8Quantization(QuantizationConfig):
    """Every linear layer (attention and MLP projections) in FP8; embeddings, the LM head,
    norms and MoE experts stay in the model's dtype. ``checkpoint``: the checkpoint's
    ``quantization_config`` when it is already FP8 (None: quantize at load)."""

    name = "fp8"

    def __init__(self, checkpoint: dict | None = None) -> None:
        self.checkpoint = checkpoint

    @classmethod
    def detects(cls, model_path: str, hf_config: Any) -> bool:
        return _quant_method(hf_config) == "fp8"

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any) -> Fp8Quantization:
        qc = getattr(hf_config, "quantization_config", None)
        if not qc:
            return cls()
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        if qc.get("quant_method") != "fp8":
            raise ValueError(
                f"--quantization fp8 reads FP8 checkpoints or quantizes bf16 / fp32 ones; "
                f"{model_path} is quantized with {qc.get('quant_method')!r}"
            )
        if qc.get("weight_block_size"):
            raise ValueError(
                f"{model_path}: block-wise FP8 scales (weight_block_size "
                f"{qc['weight_block_size']}) are not read; per-tensor scales are"
            )
        return cls(qc)

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        if self.checkpoint is None:
            return Fp8LinearMethod()
        return Fp8CheckpointLinearMethod(self.checkpoint.get("activation_scheme") == "static")
