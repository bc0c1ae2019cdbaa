"""Different attention backends for prefill and decode (``--prefill-attention-backend``,
``--decode-attention-backend``, as in SGLang).

Both read and write the same paged KV pool, so a batch may go to either: extend batches (prefill,
chunked prefill, mixed chunks) run on the prefill backend, decode batches (and so the CUDA graphs)
on the decode backend. The point is that the best kernel differs by phase: FlashInfer's prefill
kernels are the fastest extend on a GPU, while its decode plans every step on the host (~0.5 ms a
step for SmolLM2 on the H200, half of a host-bound step), which Loom's Triton decode does not.
"""

from __future__ import annotations

from typing import Any

from loom.layers.attention.base import AttentionBackend


class HybridAttnBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.features = prefill.features & decode.features
        super().__init__(decode.ctx)
        self.prefill_backend = prefill
        self.decode_backend = decode
        # graphs replay decode only
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.plans_on_host = decode.plans_on_host
        self.supports_torch_compile = decode.supports_torch_compile
        # a mixed step is an extend batch: the prefill backend runs it whole
        self.supports_mixed_graph = prefill.supports_mixed_graph

    def _pick(self, batch) -> AttentionBackend:
        return self.decode_backend if batch.is_decode else self.prefill_backend

    def plans_on_host_for(self, bs: int) -> bool:
        return self.decode_backend.plans_on_host_for(bs)

    def graph_wrapper(self, bs: int, max_kv_tokens: int) -> Any:
        return self.decode_backend.graph_wrapper(bs, max_kv_tokens)

    def mixed_graph_metadata(self, batch, *args, **kw) -> Any:
        return self.prefill_backend.mixed_graph_metadata(batch, *args, **kw)

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
        return self.decode_backend.forward_decode(q, layer, batch)
