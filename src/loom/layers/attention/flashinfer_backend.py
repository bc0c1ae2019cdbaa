"""The ``flashinfer`` attention backend, on the ``flashinfer-python`` package (CUDA only).

Loom's KV pool is ``[num_slots, kv_heads, head_dim]`` per layer; FlashInfer sees it as a paged
cache with pages of one slot (``[num_slots, 1, kv_heads, head_dim]``, NHD), so the page table of
a request is simply its row of the req-to-token table, whatever ``--page-size`` is.

FlashInfer plans on the host (it reads the KV lengths to split work), so this backend sets
``plans_on_host``: the CUDA graph runner calls ``init_forward_metadata`` outside the graph, before
capture and before every replay, and the graph holds only the kernels. Each captured batch size
has its own decode wrapper over fixed index buffers, as FlashInfer's CUDA-graph mode requires.
FlashInfer has no fp32 kernels: the backend accepts fp16 and bf16 models only, with a KV cache
of the model's dtype or ``fp8_e4m3`` (``--kv-cache-dtype``; a 16-bit query over fp8 K/V).

Sliding windows and logit soft caps are plan arguments of FlashInfer's wrappers (``window_left``
= ``sliding_window - 1``, ``logits_soft_cap``; each pair is its own compiled kernel variant, and
``run`` must use the plan's window), while Loom's are per layer (Gemma 2/3 alternate local and
global layers). So each distinct (window, cap) of the model's layers gets a wrapper of its own,
planned every step over the same KV indices, the variants sharing the float workspace (used by
one kernel at a time, in stream order). The backend learns the variants from the layers (its
context lists only which features they use): plain layers' is planned from the start, and a
layer whose variant has no plan yet plans it on first use (eager forwards only), after which
every step plans it up front. The CUDA graph runner runs two eager forwards of each batch size
before capturing it, so a captured graph replays only plans made outside it. Cost: one plan per
variant per step (two for Gemma 2, three for a model of windows only: the plain plan stays) and
an int workspace per variant and graph batch size.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loom.layers.attention.base import ATTENTION_FEATURES, AttentionBackend

_WORKSPACE_BYTES = 256 << 20
_HEAD_DIMS = (64, 128, 256)  # FlashInfer's prefill kernels reject others (seen on the H200: 16)


@functools.cache
def import_error() -> str | None:
    """Why ``flashinfer`` cannot be used here, or None when it imports."""
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # noqa: BLE001 - any failure means unavailable; say which
        return f"{type(e).__name__}: {e}"
    return None


# a layer's (sliding_window, logit_cap), 0 for none: the key of a planned wrapper
_Variant = tuple[int, float]
_PLAIN: _Variant = (0, 0.0)


def _variant(layer) -> _Variant:
    return layer.sliding_window, layer.logit_cap


def _variant_kwargs(variant: _Variant) -> dict[str, Any]:
    """FlashInfer's plan arguments: ``window_left`` counts the keys a query sees before its own
    token (-1: all), so HF's window of W keys (the query's own included) is W - 1. None for
    plain layers (FlashInfer's defaults)."""
    if variant == _PLAIN:
        return {}
    window, cap = variant
    return {"window_left": window - 1 if window else -1, "logits_soft_cap": cap}


@dataclass
class _Metadata:
    # this step's plan of a variant: called for the first layer of a variant not yet planned
    plan: Callable[[_Variant], Any]
    wrappers: dict[_Variant, Any] = field(default_factory=dict)


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    plans_on_host = True
    # checked on the H200 against torch_native (tests/test_conformance.py's CUDA kit and the
    # window/cap decode graphs of tests/gpu/test_cuda_attention_graphs.py)
    features: frozenset[str] = frozenset(ATTENTION_FEATURES)

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        return device.type == "cuda" and import_error() is None

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in (torch.float16, torch.bfloat16)

    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        """On CUDA, first for prefill: on the H200 (docs/benchmarks.md) FlashInfer 0.7.4's
        prefill served the 1000-request Llama-3-8B workload at 8,081 output tok/s against 2,796
        for Loom's Triton kernels. Second for decode, which it plans on the host every step."""
        if device.type != "cuda":
            return None
        return 40 if phase == "prefill" else 30

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if ctx.head_dim not in _HEAD_DIMS:
            raise ValueError(
                f"the flashinfer attention backend supports head_dim {_HEAD_DIMS}, "
                f"not {ctx.head_dim}"
            )
        self.kv_dtype = ctx.kv_pool.dtype if ctx.kv_pool is not None else ctx.dtype
        if self.kv_dtype not in (ctx.dtype, torch.float8_e4m3fn):
            raise ValueError(
                f"the flashinfer attention backend reads a KV cache of the model's dtype or "
                f"fp8_e4m3, not {self.kv_dtype} (--kv-cache-dtype): use --attention-backend "
                "triton"
            )
        if not self.supports_dtype(ctx.dtype):
            raise ValueError(
                f"the flashinfer attention backend has no {ctx.dtype} kernels; "
                "use --dtype bfloat16/float16 or another --attention-backend"
            )
        import flashinfer

        self._fi = flashinfer
        dev = ctx.device
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # GQA with a group of 4 or more runs faster on the tensor-core (prefill) kernels.
        self.decode_tensor_cores = ctx.num_heads // ctx.num_kv_heads >= 4
        # per variant (see the module's docstring), created on first use
        self.prefill: dict[_Variant, Any] = {}
        self.decode: dict[_Variant, Any] = {}
        self.graph_wrappers: dict[tuple[int, _Variant], Any] = {}
        self._graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the variants planned every step: plain layers' from the start (as most models have
        # them only), the others' once a layer has used them
        self.variants: list[_Variant] = [_PLAIN]
        self._graph_indices: torch.Tensor | None = None
        self._ones = torch.ones(1024, dtype=torch.int32, device=dev)
        # Per wrapper: an event after its last plan's copies. ``plan`` fills a pinned host
        # buffer and copies it to the device without waiting; with overlap the next plan can
        # come while that copy is still queued behind the step in flight, so it waits for the
        # event first (in practice already passed: the step before has been waited for).
        self._planned: dict[int, torch.cuda.Event] = {}
        self.default_scale = ctx.head_dim**-0.5

    # ---- plan -----------------------------------------------------------------------------

    def _kv_indices(self, batch, lens_cpu: list[int], out: torch.Tensor | None = None):
        """Concatenated KV slots of each request (device), built without a host sync."""
        total = sum(lens_cpu)
        dev = batch.req_pool_indices.device
        lens = torch.tensor(lens_cpu, dtype=torch.int64).to(dev, non_blocking=True)
        starts = torch.cumsum(lens, 0) - lens
        rows = torch.repeat_interleave(batch.req_pool_indices, lens, output_size=total)
        cols = torch.arange(total, device=dev) - torch.repeat_interleave(
            starts, lens, output_size=total
        )
        idx = batch.req_to_token_pool.req_to_token[rows, cols].to(torch.int32)
        if out is not None:
            out[:total].copy_(idx)
            return out[:total]
        return idx

    def _last_page_len(self, bs: int) -> torch.Tensor:
        if bs > self._ones.shape[0]:
            self._ones = torch.ones(bs, dtype=torch.int32, device=self._ones.device)
        return self._ones[:bs]

    def graph_wrapper(self, bs: int, max_kv_tokens: int) -> None:
        """Set up the fixed index buffers that the CUDA graph of batch size ``bs`` reads; its
        wrappers (one per variant, all over these buffers) come with their first plan."""
        if bs not in self._graph_buffers:
            dev = self.ctx.device
            if self._graph_indices is None or self._graph_indices.shape[0] < max_kv_tokens:
                self._graph_indices = torch.zeros(max_kv_tokens, dtype=torch.int32, device=dev)
            self._graph_buffers[bs] = (
                torch.zeros(bs + 1, dtype=torch.int32, device=dev),
                torch.ones(bs, dtype=torch.int32, device=dev),
            )

    def _decode_wrapper(self, graph_bs: int | None, variant: _Variant):
        """The eager decode wrapper of ``variant``, or the one the graph of ``graph_bs`` replays
        (every variant's plan copies the same indices into the graph's buffers)."""
        if graph_bs is None:
            if variant not in self.decode:
                self.decode[variant] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores
                )
            return self.decode[variant]
        key = (graph_bs, variant)
        if key not in self.graph_wrappers:
            indptr, last_page_len = self._graph_buffers[graph_bs]
            self.graph_wrappers[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
        return self.graph_wrappers[key]

    def _prefill_wrapper(self, variant: _Variant):
        if variant not in self.prefill:
            self.prefill[variant] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD"
            )
        return self.prefill[variant]

    def _plan(self, wrapper, *args, **kwargs) -> None:
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.ctx.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self._planned[id(wrapper)] = done

    def prepare_host(self, batch):
        ctx = self.ctx
        bs = batch.batch_size
        lens_cpu = list(batch.seq_lens_cpu)
        indptr = torch.zeros(bs + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(lens_cpu, dtype=torch.int32), 0, out=indptr[1:])
        indices = self._kv_indices(batch, lens_cpu)
        # fp8_e4m3 caches: FlashInfer's kernels take a 16-bit query over fp8 K/V (stored
        # unscaled, so the default scales of 1 apply)
        common = dict(q_data_type=ctx.dtype, kv_data_type=self.kv_dtype)
        heads = (ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, 1)  # ..., page size 1
        if batch.is_decode:
            graph_bs = getattr(batch, "graph_bs", None)

            def plan(variant: _Variant):
                wrapper = self._decode_wrapper(graph_bs, variant)
                self._plan(
                    wrapper,
                    indptr,
                    indices,
                    self._last_page_len(bs),
                    *heads,
                    **common,
                    **_variant_kwargs(variant),
                )
                return wrapper

        else:
            qo = torch.zeros(bs + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor(batch.extend_seq_lens_cpu, dtype=torch.int32), 0, out=qo[1:])

            def plan(variant: _Variant):
                wrapper = self._prefill_wrapper(variant)
                self._plan(
                    wrapper,
                    qo,
                    indptr,
                    indices,
                    self._last_page_len(bs),
                    *heads,
                    causal=True,
                    **common,
                    **_variant_kwargs(variant),
                )
                return wrapper

        md = _Metadata(plan)
        for variant in self.variants:
            md.wrappers[variant] = plan(variant)
        return md

    # ---- run ------------------------------------------------------------------------------

    def _run(self, q, layer, batch):
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        shape = (k_buf.shape[0], 1, layer.num_kv_heads, layer.head_dim)
        q = q.view(-1, layer.num_heads, layer.head_dim)
        if abs(layer.scaling - self.default_scale) > 1e-12:
            q = q * (layer.scaling / self.default_scale)
        md: _Metadata = batch.attn_metadata
        variant = _variant(layer)
        wrapper = md.wrappers.get(variant)
        if wrapper is None:  # the first layer of this variant: plan it, and every step on
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"attention variant {variant} first seen inside a CUDA graph capture: "
                    "run an eager forward of the batch first"
                )
            if variant not in self.variants:
                self.variants.append(variant)
            wrapper = md.wrappers[variant] = md.plan(variant)
        out = wrapper.run(q, (k_buf.view(shape), v_buf.view(shape)))
        return out.view(-1, layer.num_heads * layer.head_dim)

    def forward_extend(self, q, layer, batch):
        return self._run(q, layer, batch)

    def forward_decode(self, q, layer, batch):
        return self._run(q, layer, batch)
