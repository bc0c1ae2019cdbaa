"""CUDA graphs for decode: one graph per batch-size bucket, replayed with the batch copied into
static buffers. Launch overhead, not bandwidth, limits small-batch decode on a GPU (an eager
SmolLM2-sized step measured 20 ms on the H200, the same step as a graph 3 ms).

Padding rows (bucket size > real batch) decode a dummy token at position 0 with ``seq_len`` 1
from req-to-token row 0 and write their K/V into slot 0, the padding page: its contents are
therefore finite but arbitrary, which every backend tolerates (they never weight it).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from loom.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


_FIELDS, _SEQ_LENS = 5, 2  # rows of the packed batch description; the seq_lens row


def batch_size_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, 1025, 32))
    return sorted({b for b in sizes if b <= max_bs} | {max_bs})


class CudaGraphRunner:
    """``forward(batch, plan)``: the model's forward over a batch (``plan``: let the attention
    backend plan it first); ``attach(batch)``: the batch with the KV pools and the backend
    attached; ``context_len``: the longest sequence a captured batch may attend over."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch, bool], torch.Tensor],
        attach: Callable[[ForwardBatch], ForwardBatch],
        backend,
        device: torch.device,
        context_len: int,
        max_bs: int,
        lora=None,
    ) -> None:
        """``lora``: the LoRA manager when its backend runs inside graphs (each row's adapter
        slot is then a graph input: one graph per batch size serves any mix of adapters)."""
        self.forward = forward
        self.attach = attach
        self.backend = backend
        self.context_len = context_len
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        dev = device
        # The batch description as the runner packs it (input ids, positions, seq_lens,
        # req-to-token rows, new slots: one row each), so that a replay copies it in one op.
        # Padding rows decode token 0 at position 0 with seq_len 1 from row 0 into slot 0.
        self.static = torch.zeros(_FIELDS, self.max_bs, dtype=torch.int64, device=dev)
        self.static[_SEQ_LENS].fill_(1)
        self.padding = self.static.clone()
        (self.input_ids, self.positions, self.seq_lens, self.req_pool_indices,
         self.out_cache_loc) = self.static.unbind(0)  # fmt: skip
        self.lora = lora
        # each row's adapter slot (-1: the base model; padding rows -1)
        self.lora_slots = torch.full((self.max_bs,), -1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first: smaller ones reuse its pool
                self._capture(bs)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.buckets)

    def _batch(self, bs: int, seq_lens_cpu: list[int] | None = None) -> ForwardBatch:
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu or [1] * bs,
            graph_bs=bs,
        )
        return self.attach(batch)

    def _plan(self, bs: int, seq_lens_cpu: list[int] | None = None) -> ForwardBatch:
        """``plans_on_host`` backends: plan this step outside the graph."""
        batch = self._batch(bs, seq_lens_cpu)
        self.backend.init_forward_metadata(batch)
        return batch

    def _capture(self, bs: int) -> None:
        if self.lora is not None:
            self.lora.active = self.lora.backend.graph_batch(self.lora_slots[:bs])
        try:
            self._capture_bs(bs)
        finally:
            if self.lora is not None:
                self.lora.active = None

    def _capture_bs(self, bs: int) -> None:
        host_plan = self.backend.plans_on_host_for(bs)
        if host_plan:
            self.backend.graph_wrapper(bs, self.max_bs * self.context_len)
        for _ in range(2):  # compile kernels and settle the allocator outside the graph
            if host_plan:
                self.forward(self._plan(bs), False)
            else:
                self.forward(self._batch(bs), True)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        batch = self._plan(bs) if host_plan else self._batch(bs)
        self.outputs[bs] = self._record(graph, lambda: self.forward(batch, not host_plan))
        self.graphs[bs] = graph

    def _record(self, graph, forward):
        """Capture ``forward()`` into ``graph``; its output tensor is what replays refill."""
        with torch.cuda.graph(graph, pool=self.pool):
            return forward()

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def replay(
        self,
        packed: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        seq_lens_cpu: list[int] | None = None,
        lora_slots: list[int] | None = None,
    ) -> torch.Tensor:
        """``packed``: the runner's ``[5, bs]`` batch description on the device (see
        ``static``); ``input_ids``: the step's ids when they are already on the device (the
        previous step's samples), replacing its first row. One copy for the batch, one for the
        padding rows, one for device-side ids: the host's work per step is a few ops."""
        bs = packed.shape[1]
        gbs = self.buckets[bisect.bisect_left(self.buckets, bs)]
        self.static[:, :bs].copy_(packed)
        if input_ids is not None:
            self.input_ids[:bs].copy_(input_ids)
        if gbs > bs:
            self.static[:, bs:gbs].copy_(self.padding[:, bs:gbs])
        if self.lora is not None:
            slots = torch.tensor(lora_slots or [-1] * bs, dtype=torch.int32)
            self.lora_slots[:bs].copy_(slots, non_blocking=True)
            self.lora_slots[bs:gbs].fill_(-1)
        if self.backend.plans_on_host_for(gbs):
            if seq_lens_cpu is None:
                raise ValueError(f"{type(self.backend).__name__} needs the host's seq_lens")
            self._plan(gbs, list(seq_lens_cpu) + [1] * (gbs - bs))
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
