"""Linear layers, tensor-parallel ready.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that takes the
*full* checkpoint tensor and copies this rank's shard into place, so the generic loader never knows
about sharding or packing. Packed layers (qkv, gate_up) take a ``shard_id`` naming the part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed import (
    divide,
    get_tp_rank,
    get_tp_size,
    head_shard,
    tp_all_gather,
    tp_all_reduce,
)
from loom.layers.gemv import gemv, use_gemv


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by a loader (or the dummy loader).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def relayout_for_cpu_gemv(weight: torch.Tensor) -> None:
    """Store an fp32 CPU weight column-major (same shape, transposed strides).

    On CPU, fp32 ``x @ W.T`` with W stored ``[in, out]``-contiguous runs ~25% faster at small
    batch than with the usual ``[out, in]`` layout (oneDNN/MKL GEMV; measured in
    docs/benchmarks.md); larger batches and bf16 gain nothing, so only fp32 on CPU is changed.
    """
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        weight.data = weight.data.t().contiguous().t()


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear``, or Loom's Triton GEMV for a single CUDA row when enabled (layers/gemv.py)."""
    if use_gemv(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class LinearBase(nn.Module):
    # set by quantization.base.apply_quantization: the layer's own storage and matmul
    quant_method = None

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()

    def _init_params(self, out_features: int, in_features: int, bias: bool) -> None:
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded)

    def process_weights_after_loading(self) -> None:
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)
        else:
            relayout_for_cpu_gemv(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        self._init_params(output_size, input_size, bias)


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split along its output dimension; each rank holds output_size / tp rows."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False
    ) -> None:
        super().__init__(input_size, output_size, bias)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self._init_params(self.output_size_per_partition, input_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x):
        y = self.matmul(x, self.bias)
        return tp_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (e.g. gate_up); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # a checkpoint that already stores the merged matrix
            return super().weight_loader(param, loaded)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(divide(s, self.tp_size) for s in self.output_sizes[:shard_id])
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; shard_id is "q", "k" or "v". Each rank holds the heads of
    ``distributed.head_shard``: KV heads spread over the ranks (replicated when there are
    fewer of them than ranks) with their groups' query heads."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        LinearBase.__init__(self, hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)
        self.gather_output = False
        shard = head_shard(num_heads, num_kv_heads, self.tp_rank, self.tp_size)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.q_start, self.kv_start = shard.q_start * head_dim, shard.kv_start * head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.output_size_per_partition = self.q_size + 2 * self.kv_size
        self._init_params(self.output_size_per_partition, hidden_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError("QKVParallelLinear loads q, k and v separately")
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.q_start
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_start
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split along its input dimension; partial results are summed across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        partition: tuple[int, int] | None = None,
    ) -> None:
        """``partition``: this rank's ``(start, size)`` of the input (an attention output of
        unevenly spread heads); an even split by default."""
        super().__init__(input_size, output_size, bias)
        self.reduce_results = reduce_results
        if partition is None:
            size = divide(input_size, self.tp_size)
            partition = (self.tp_rank * size, size)
        self.input_start, self.input_size_per_partition = partition
        self._init_params(output_size, self.input_size_per_partition, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias (or a per-row scale): whole on every rank
            return _copy(param, loaded)
        start = self.input_start
        cut = getattr(param, "input_columns", None)  # a quantized form's columns
        if cut is not None:
            start, _ = cut(start, self.input_size_per_partition)
        _copy(param, loaded.narrow(1, start, param.shape[1]))

    def forward(self, x):
        y = self.matmul(x, None)
        if self.reduce_results:
            y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias
