"""A batch's per-token adapter slots as the multi-LoRA kernels (``triton_ops``) read them.

- ``LoRABatch.token_slot``: ``[T]`` int32 on the device, one pool slot per token in batch
  order, ``-1`` for a token with no adapter. Under a CUDA graph it is the graph's static input
  buffer, refilled before each replay, so nothing else in the batch may depend on its values.
- ``LoRABatch.segments``: the same slots as maximal runs of consecutive tokens on one slot, in
  token order, ``-1`` tokens in no run; ``start``, ``length`` and ``slot`` are ``[G]`` int32 on
  the device and ``max_len`` is ``max(length)`` on the host (0 for no run), since the segment
  kernels' grid is sized from it. None for a batch that only the gather kernels see (any
  captured step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Segments:
    """Runs of consecutive tokens on one slot (runs of ``-1`` left out), as device int32."""

    start: torch.Tensor  # [G] first token of each run
    length: torch.Tensor  # [G]
    slot: torch.Tensor  # [G]
    max_len: int  # host copy of max(length): the segment kernels' grid


@dataclass
class LoRABatch:
    """A batch's per-token slots for the kernels: ``token_slot`` [T] int32 on the device (a
    CUDA graph's static buffer for captured steps), plus its ``segments`` for eager steps
    (None: the gather kernels at any size, as under a graph)."""

    token_slot: torch.Tensor
    segments: Segments | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]


def segments_of(slots: Sequence[int], device: torch.device | str) -> Segments:
    """The runs of equal non-negative slots in ``slots`` (host ints, one per token)."""
    start, length, slot = [], [], []
    prev = -1
    for t, s in enumerate(slots):
        if s >= 0 and s == prev:
            length[-1] += 1
        elif s >= 0:
            start.append(t)
            length.append(1)
            slot.append(s)
        prev = s
    # Each row starts 16 bytes past the previous one's start or a multiple of that: Triton
    # specialises pointers on 16-byte alignment, so unaligned rows (2 segments: length at +8
    # bytes) compile other kernel variants than aligned ones (64 segments), and the start-up
    # warm-up's few segments would not cover a full batch's (on the H200 a first SmolLM2 batch
    # of 64 prompts on 8 adapters compiled two kernels in its prefill: 1.13 s against 0.09 s).
    g = len(start)
    width = -(-max(g, 1) // 4) * 4
    rows = torch.zeros(3, width, dtype=torch.int32)
    rows[:, :g] = torch.tensor([start, length, slot], dtype=torch.int32).reshape(3, -1)
    rows = rows.to(device, non_blocking=True)
    return Segments(rows[0, :g], rows[1, :g], rows[2, :g], max(length, default=0))


def make_lora_batch(
    slots: Sequence[int], device: torch.device | str, *, segments: bool = True
) -> LoRABatch:
    """A :class:`LoRABatch` from host per-token slots (``-1``: no adapter); ``segments=False``
    for a batch that only the gather kernels will see."""
    token_slot = torch.tensor(list(slots), dtype=torch.int32).to(device, non_blocking=True)
    return LoRABatch(token_slot, segments_of(slots, device) if segments else None)
