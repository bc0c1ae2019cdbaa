"""The device pool's layout: one flat row per slot holding an adapter's A and B for every layer's
targeted packed projection, and the same row built on the host from a PEFT adapter.

A slot's row is the whole adapter, so bringing an adapter onto the device is one copy (from
pinned host memory, on a side stream) and the host tier keeps adapters in exactly that form.
Per (layer, packed module) the row holds ``A`` [slices * R, in] and ``B`` [out, slices * R],
where R is the pool's rank: slice ``j``'s A rows sit at ``j * R``, zero-padded past the
adapter's rank, and ``B`` is block-diagonal (rows of slice ``j`` have non-zeros only in
columns ``j * R ...``), so one shrink and one expand cover the packed module's slices. Every
part starts on a multiple of ``ALIGN`` elements so the kernels' loads stay aligned. Under tensor
parallelism a rank's row holds its shard of each A and B (``shard.py``).
"""

from __future__ import annotations

import torch

from loom.lora.adapter import LoRAAdapter
from loom.lora.shard import ModuleShard, shard_pair

# Loom's packed projections and the PEFT modules that are their slices, in output order.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PoolLayout:
    """``shards``: each targeted packed module's shard on this rank (its local input size and
    slice output sizes size the row); ``rank``: R."""

    def __init__(self, num_layers: int, shards: dict[str, ModuleShard], rank: int):
        self.num_layers, self.shards, self.rank = num_layers, dict(shards), rank
        self.sizes = {p: (s.local_in, s.local_outs) for p, s in self.shards.items()}
        # (layer, packed) -> ((offset, shape) of A, (offset, shape) of B)
        self.parts: dict[tuple[int, str], tuple[tuple[int, tuple], tuple[int, tuple]]] = {}
        off = 0
        for layer in range(num_layers):
            for packed, (n_in, outs) in self.sizes.items():
                k = len(outs) * rank
                a_shape, b_shape = (k, n_in), (sum(outs), k)
                a_off = off
                off = _aligned(off + k * n_in)
                self.parts[(layer, packed)] = ((a_off, a_shape), (off, b_shape))
                off = _aligned(off + b_shape[0] * k)
        self.numel = off

    def views(self, rows: torch.Tensor) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per layer, per packed module: (A, B) as views of ``rows`` ([slots, numel] gives
        [slots, ...] views; a single [numel] row gives one adapter's)."""
        lead = rows.shape[:-1]
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(self.num_layers)
        ]
        for (layer, packed), ((a_off, a_shape), (b_off, b_shape)) in self.parts.items():
            a = rows[..., a_off : a_off + a_shape[0] * a_shape[1]].view(*lead, *a_shape)
            b = rows[..., b_off : b_off + b_shape[0] * b_shape[1]].view(*lead, *b_shape)
            out[layer][packed] = (a, b)
        return out

    def host_row(self, adapter: LoRAAdapter, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """The adapter as one slot row on the host (in page-locked memory with ``pin``)."""
        row = torch.zeros(self.numel, dtype=dtype, pin_memory=pin)
        r = self.rank
        views = self.views(row)
        for layer in range(self.num_layers):
            for packed, (a_view, b_view) in views[layer].items():
                outs = self.sizes[packed][1]
                for j, module in enumerate(PACKED[packed]):
                    w = adapter.weights.get((layer, module))
                    if w is None:
                        continue
                    a, b = shard_pair(self.shards[packed], j, *w)
                    k = a.shape[0]
                    first = sum(outs[:j])
                    a_view[j * r : j * r + k].copy_(a)
                    b_view[first : first + outs[j], j * r : j * r + k].copy_(b)
        return row
