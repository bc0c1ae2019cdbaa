"""Adapters under tensor parallelism: each rank holds the part of an adapter's A and B that
meets its shard of the base projection.

- Column-parallel projections (q / k / v, gate / up) hold a slice of the output rows on each
  rank: A stays whole and B keeps the same rows as the base weight (for q / k / v the rows of
  ``distributed.head_shard``'s heads, so an uneven split such as SmolLM2's 6 + 3 query heads
  follows the base layer).
- Row-parallel projections (o, down) see a slice of the input on each rank: A keeps the
  columns of that slice and B stays whole. Each rank's ``B (A_r x_r)`` is a partial sum like the
  base layer's ``W_r x_r``; the update is added before the base layer's all-reduce, whose sum
  is ``B A x`` with no collective of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModuleShard:
    """One packed projection on this rank: the full input and slice sizes (what a checkpoint
    holds), the input columns this rank reads (start, size), and each slice's output rows
    (start, size) in the full slice."""

    full_in: int
    full_outs: tuple[int, ...]
    cols: tuple[int, int]
    rows: tuple[tuple[int, int], ...]
    row_parallel: bool

    @property
    def local_in(self) -> int:
        return self.cols[1]

    @property
    def local_outs(self) -> list[int]:
        return [n for _, n in self.rows]


def module_shard(base: nn.Module, packed: str) -> ModuleShard:
    """The shard of ``base`` (Loom's linear layer for ``packed``) that this rank holds."""
    n_in = base.input_size
    if packed == "qkv_proj":
        hd = base.head_dim
        q, kv = base.total_num_heads * hd, base.total_num_kv_heads * hd
        rows = ((base.q_start, base.q_size), (base.kv_start, base.kv_size)) + (
            (base.kv_start, base.kv_size),
        )
        return ModuleShard(n_in, (q, kv, kv), (0, n_in), rows, False)
    if packed == "gate_up_proj":
        outs = tuple(base.output_sizes)
        rows = tuple((base.tp_rank * (n // base.tp_size), n // base.tp_size) for n in outs)
        return ModuleShard(n_in, outs, (0, n_in), rows, False)
    # o_proj, down_proj: row-parallel
    cols = (base.input_start, base.input_size_per_partition)
    out = base.output_size
    return ModuleShard(n_in, (out,), cols, ((0, out),), True)


def shard_pair(
    shard: ModuleShard, j: int, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slice ``j``'s checkpoint A [r, full_in] and B [full_out, r] as this rank holds them."""
    c0, cn = shard.cols
    r0, rn = shard.rows[j]
    return a[:, c0 : c0 + cn], b[r0 : r0 + rn]
