"""Tensor-parallel state. Loom runs one scheduler process per TP rank; at tp_size 1 (the only size
wired up so far) every collective below is the identity, so models never branch on TP."""

from __future__ import annotations

import torch

_tp_rank = 0
_tp_size = 1
_tp_group = None


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


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator
