"""Different attention backends for prefill and decode (``--prefill-attention-backend``,
``--decode-attention-backend``, as in SGLang).

Both read and write the same paged KV pool, so a batch may go to either: extend batches (prefill,
chunked prefill, mixed chunks) run on the prefill backend, decode batches (and so the CUDA graphs)
on the decode backend. The point is that the best kernel differs by phase: FlashInfer's prefill
kernels are the fastest extend on a GPU, while its decode plans every step on the host (~0.5 ms a
step for SmolLM2 on the H200, half of a host-bound step), which Loom's Triton decode does not;
at batches of hundreds on an 8B model FlashInfer's decode kernels are faster again, so ``auto``
switches decode to them above a batch size (``model_runner._AUTO_DECODE_LARGE``).
"""

from __future__ import annotations

from typing import Any

from loom.layers.attention.base import AttentionBackend


class HybridAttnBackend(AttentionBackend):
    """``decode_large``, when given, serves decode batches larger than ``large_above`` (a CUDA
    graph bucket size, so that an eager step and the graph padding it pick the same one)."""

    def __init__(
        self,
        prefill: AttentionBackend,
        decode: AttentionBackend,
        decode_large: AttentionBackend | None = None,
        large_above: int | None = None,
    ) -> None:
        super().__init__(decode.ctx)
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.decode_large = decode_large
        self.large_above = large_above
        decoders = [decode] + ([decode_large] if decode_large is not None else [])
        # graphs replay decode only
        self.supports_cuda_graph = all(d.supports_cuda_graph for d in decoders)
        self.plans_on_host = any(d.plans_on_host for d in decoders)

    def decode_for(self, bs: int) -> AttentionBackend:
        if self.decode_large is not None and bs > self.large_above:
            return self.decode_large
        return self.decode_backend

    def _pick(self, batch) -> AttentionBackend:
        return self.decode_for(batch.batch_size) if batch.is_decode else self.prefill_backend

    def plans_on_host_for(self, bs: int) -> bool:
        return self.decode_for(bs).plans_on_host

    def graph_wrapper(self, bs: int, max_kv_tokens: int) -> Any:
        return self.decode_for(bs).graph_wrapper(bs, max_kv_tokens)

    def init_forward_metadata(self, batch) -> None:
        self._pick(batch).init_forward_metadata(batch)

    def prepare_host(self, batch) -> Any:
        return self._pick(batch).prepare_host(batch)

    def prepare_device(self, batch, metadata) -> None:
        self._pick(batch).prepare_device(batch, metadata)

    def forward(self, q, k, v, layer, batch, save_kv: bool = True):
        return self._pick(batch).forward(q, k, v, layer, batch, save_kv=save_kv)

    def forward_extend(self, q, layer, batch):
        return self.prefill_backend.forward_extend(q, layer, batch)

    def forward_decode(self, q, layer, batch):
        return self.decode_for(batch.batch_size).forward_decode(q, layer, batch)
