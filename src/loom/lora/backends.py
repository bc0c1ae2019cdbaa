"""The ``lora_backend`` family (``--lora-backend``): how a batch's adapter updates
``y += B_slot (A_slot x)`` are computed over the slot pool (``manager.py``'s buffers).

A member turns the batch's per-request slots into its own batch description (``prepare``, once
a forward, on the host) and applies one packed projection's updates (``apply``, per layer and
projection). Built-ins:

- ``torch_native``: tokens grouped by slot, a gathered matmul pair and ``index_add_`` per slot
  (the reference; the CPU's default).
- ``triton``: ``triton_ops``' kernels, one shrink and one expand launch per projection for all
  adapters of the batch (gather kernels when runs of one adapter are short, segmented ones
  when they are long); the default on CUDA.
- ``auto``: ``triton`` on CUDA when Triton is importable, else ``torch_native``.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class LoRABackend(ABC):
    name = ""

    @abstractmethod
    def prepare(self, per_token: list[int], device: torch.device) -> Any:
        """The batch description from each token's slot (``-1``: none; not all -1)."""

    def graph_batch(self, token_slot: torch.Tensor) -> Any | None:
        """The batch description over ``token_slot`` (a CUDA graph's static int32 buffer, one
        slot per row, filled before each replay), or None when this member cannot run inside
        a graph (the decode steps with adapters then run eagerly)."""
        return None

    @abstractmethod
    def apply(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a_buf: torch.Tensor,
        b_buf: torch.Tensor,
        slice_sizes: Sequence[int],
        batch: Any,
    ) -> torch.Tensor:
        """``y`` ``[T, out]`` plus each token's adapter update of ``x`` ``[T, in]``."""


class TorchNativeLoRABackend(LoRABackend):
    name = "torch_native"

    def prepare(self, per_token, device):
        used = sorted(set(per_token) - {-1})
        if len(used) == 1 and min(per_token) >= 0:  # one adapter for every token
            return [(used[0], None)]
        slots = torch.tensor(per_token)
        return [
            (s, torch.nonzero(slots == s).flatten().to(device, non_blocking=True)) for s in used
        ]

    def apply(self, x, y, a_buf, b_buf, slice_sizes, batch):
        for slot, idx in batch:
            a, b = a_buf[slot], b_buf[slot]
            if idx is None:
                y += (x @ a.t()) @ b.t()
            else:
                y.index_add_(0, idx, (x.index_select(0, idx) @ a.t()) @ b.t())
        return y


class TritonLoRABackend(LoRABackend):
    name = "triton"

    def prepare(self, per_token, device):
        from loom.lora.batch import make_lora_batch

        return make_lora_batch(per_token, device)

    def graph_batch(self, token_slot):
        from loom.lora.batch import LoRABatch

        return LoRABatch(token_slot)  # no segments: the gather kernels, whose grid is fixed

    def apply(self, x, y, a_buf, b_buf, slice_sizes, batch):
        from loom.lora.triton_ops import lora_shrink_expand

        return lora_shrink_expand(x, y, a_buf, b_buf, slice_sizes, batch)


class AutoLoRABackend(LoRABackend):
    """``triton`` on CUDA when Triton is importable, else ``torch_native``."""

    name = "auto"

    def __init__(self) -> None:
        self._triton = TritonLoRABackend() if importlib.util.find_spec("triton") else None
        self._native = TorchNativeLoRABackend()

    def _pick(self, device: torch.device) -> LoRABackend:
        return self._triton if device.type == "cuda" and self._triton else self._native

    def prepare(self, per_token, device):
        backend = self._pick(device)
        return backend, backend.prepare(per_token, device)

    def graph_batch(self, token_slot):
        backend = self._pick(token_slot.device)
        inner = backend.graph_batch(token_slot)
        return None if inner is None else (backend, inner)

    def apply(self, x, y, a_buf, b_buf, slice_sizes, batch):
        backend, inner = batch
        return backend.apply(x, y, a_buf, b_buf, slice_sizes, inner)
