"""The attention_backend family.

A backend computes attention for one layer over the paged KV pool. Per batch, the model runner
calls ``init_forward_metadata`` once; it is split into two parts so that CUDA graphs need no
contract change:

- ``prepare_host(batch)``: anything that reads host-side lists or sizes (may sync, allocate);
- ``prepare_device(batch, metadata)``: tensor work only, on buffers whose shapes depend on the
  batch size alone, so it can be recorded into a CUDA graph and replayed.

Then each attention layer calls ``forward``, which writes the new tokens' K/V into the pool at
``batch.out_cache_loc`` and dispatches to ``forward_extend`` or ``forward_decode``. Inputs
``q``/``k``/``v`` are ``[num_tokens, heads * head_dim]``; the output is ``[num_tokens,
num_heads * head_dim]``. A backend must give the same result as ``torch_native`` (the oracle),
within the dtype's tolerance.

Layers may ask for more than causal attention (``Attention.sliding_window``,
``Attention.logit_cap``); the runner lists what a model's layers use in
``AttentionContext.features``, and a backend whose kernels lack one of them raises ValueError
from its constructor (``--attention-backend auto`` then takes the next backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loom.forward_batch import ForwardBatch
    from loom.layers.attention.layer import Attention
    from loom.mem_cache.memory_pool import KVPool, ReqToTokenPool


@dataclass(frozen=True)
class AttentionContext:
    """What a backend is built from (per rank)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    kv_pool: KVPool
    req_to_token_pool: ReqToTokenPool
    # what the model's layers use beyond causal attention: "sliding_window", "logit_cap"
    features: frozenset[str] = frozenset()


ATTENTION_FEATURES = ("sliding_window", "logit_cap")


def attention_features(model: torch.nn.Module) -> frozenset[str]:
    """The features of :data:`ATTENTION_FEATURES` that ``model``'s attention layers use."""
    from loom.layers.attention.layer import Attention

    used = set()
    for m in model.modules():
        if isinstance(m, Attention):
            if m.sliding_window:
                used.add("sliding_window")
            if m.logit_cap:
                used.add("logit_cap")
    return frozenset(used)


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False
    # the entries of ATTENTION_FEATURES this backend's kernels implement
    features: frozenset[str] = frozenset()
    # True when metadata must be planned on the host for every step (e.g. FlashInfer): the CUDA
    # graph runner then calls ``init_forward_metadata`` outside the graph, before capture and
    # before each replay (with ``batch.graph_bs`` set), and captures only the layers' kernels.
    plans_on_host: bool = False
    # True when ``mixed_graph_metadata`` serves mixed steps captured whole (mixed_graph_runner)
    supports_mixed_graph: bool = False
    # True when torch.compile traces its decode forward whole (no graph break, no size read
    # as a Python int): --enable-torch-compile then compiles decode steps with it
    supports_torch_compile: bool = False

    def __init__(self, ctx: AttentionContext) -> None:
        lacking = sorted(ctx.features - self.features)
        if lacking:
            raise ValueError(
                f"{type(self).__name__} does not implement attention with {', '.join(lacking)}"
            )
        self.ctx = ctx

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device`` (used by --attention-backend auto)."""
        return True

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether this backend has kernels for a model in ``dtype``."""
        return True

    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        """How well this backend serves ``phase`` ("prefill" or "decode") on ``device``, for
        ``--attention-backend auto``: the registered backend with the highest priority that
        supports the device and dtype and builds is chosen; None keeps it out of ``auto`` (the
        default: a backend joins ``auto`` by overriding this). Loom's built-ins use 10
        (torch_native) to 40 (the fastest measured for the phase)."""
        return None

    def plans_on_host_for(self, bs: int) -> bool:
        """Whether the decode graph of batch size ``bs`` is planned on the host."""
        return self.plans_on_host

    def graph_wrapper(self, bs: int, max_kv_tokens: int) -> Any:  # noqa: B027
        """``plans_on_host`` backends: set up the fixed buffers of the graph for ``bs``."""

    def mixed_graph_metadata(
        self,
        batch: ForwardBatch,
        num_prefill_reqs: int,
        num_prefill_tokens: int,
        q_start: torch.Tensor,
        extend_lens: torch.Tensor,
        prefix_lens: torch.Tensor,
    ) -> Any:
        """``supports_mixed_graph`` backends: the metadata of a mixed step laid out as a mixed
        graph's (``batch``'s first ``num_prefill_reqs`` requests prefill the first
        ``num_prefill_tokens`` tokens, as ``q_start`` / ``extend_lens`` / ``prefix_lens`` say,
        some of them empty; each later request decodes one token), from device tensors alone:
        it is recorded in the graph."""
        raise NotImplementedError(f"{type(self).__name__} has no mixed-step graphs")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        metadata = self.prepare_host(batch)
        self.prepare_device(batch, metadata)
        batch.attn_metadata = metadata

    @abstractmethod
    def prepare_host(self, batch: ForwardBatch) -> Any:
        """Host-side preparation; returns the metadata object layers will see."""

    def prepare_device(self, batch: ForwardBatch, metadata: Any) -> None:  # noqa: B027
        """Graph-safe device-side preparation (fills buffers inside ``metadata``)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        save_kv: bool = True,
    ) -> torch.Tensor:
        if save_kv:
            batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.is_decode:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        """New tokens attend causally to the cached prefix plus themselves (KV already saved)."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor:
        """One query token per request attends to the request's whole KV (already saved)."""
