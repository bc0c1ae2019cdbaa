"""Tensor-parallel state. Loom runs one process per TP rank (``model_executor/tp.py``); at
tp_size 1 every collective below is the identity, so models never branch on TP.

Two process groups, whose collectives time out after ``--dist-timeout``: the data group (NCCL on
CUDA, gloo on CPU) carries the model's all-reduces and gathers and each step's tensors, and the
control group (gloo) the pickled calls rank 0 sends every rank (and, while the server is idle,
the pings that keep the workers' waits short of the timeout)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

_tp_rank = 0
_tp_size = 1
_tp_group = None
_ctrl_group = None


def init_distributed(
    rank: int, size: int, init_addr: str, device: torch.device, timeout_s: int, local: int = 1
) -> None:
    """Join the ``size`` ranks meeting at ``init_addr`` (``HOST:PORT``) as ``rank`` and make
    them the tensor-parallel group. On the CPU the ``local`` ranks of this host share its
    cores: each takes its part for its torch threads (with every rank on all cores, spinning
    OpenMP threads starved gloo's, and SmolLM2 decoded at 2.7 tokens/s on 2 cores)."""
    global _ctrl_group
    import os

    import torch.distributed as dist

    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _ctrl_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    set_tp(rank, size, None)


def ctrl_group():
    return _ctrl_group


def close_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    set_tp(0, 1, None)


def get_tp_rank() -> int:
    return _tp_rank


def get_tp_size() -> int:
    return _tp_size


def set_tp(rank: int, size: int, group=None) -> None:
    global _tp_rank, _tp_size, _tp_group
    _tp_rank, _tp_size, _tp_group = rank, size, group


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x, group=_tp_group)
    return x


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX, group=_tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: ``num_heads`` query heads from ``q_start`` and
    ``num_kv_heads`` KV heads from ``kv_start`` (indices into the model's heads)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int


def head_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """``rank``'s heads of ``size``. KV heads are spread as evenly as possible (the first
    ``num_kv_heads % size`` ranks hold one more), each rank taking the query heads of its KV
    heads, so GQA groups stay whole (SmolLM2's 9 query and 3 KV heads over 2 ranks: 6 + 2 and
    3 + 1). With fewer KV heads than ranks each KV head is replicated over ``size /
    num_kv_heads`` ranks, which split its group's query heads."""
    group = divide(num_heads, num_kv_heads)
    if num_kv_heads >= size:
        base, extra = divmod(num_kv_heads, size)
        kv = base + (rank < extra)
        kv_start = rank * base + min(rank, extra)
        return HeadShard(kv * group, kv_start * group, kv, kv_start)
    replicas = divide(size, num_kv_heads)
    q = divide(group, replicas)
    kv_start = rank // replicas
    return HeadShard(q, kv_start * group + (rank % replicas) * q, 1, kv_start)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def agree_on_error(error: str | None) -> str | None:
    """Every rank's ``error`` (None: it succeeded) exchanged over the control group: the first
    one of any rank, named by its rank when it is another's, or None when all succeeded."""
    every: list[str | None] = [None] * _tp_size
    torch.distributed.all_gather_object(every, error, group=ctrl_group())
    for rank, e in enumerate(every):
        if e is not None:
            return e if rank == _tp_rank else f"rank {rank}: {e}"
    return None
