"""Piecewise CUDA graphs for extend batches (prefill, chunked prefill, mixed steps).

An eager forward costs the same host time whatever its size: ~20 ms for 30-32 layers on the
H200 (hundreds of launches), which is most of a small prefill step (a 256-token prefill of the
Llama-3-8B shape computes in ~6 ms). Extend batches cannot be captured whole, since attention's
work depends on each request's prefix and length; everything else in a layer (norms,
projections, rotary, the MLP) works per token and depends only on the number of tokens. So for
each token-count bucket the model's forward is captured as a chain of graphs split at every
attention call: graph 0 runs up to the first layer's attention inputs, graph i from layer i-1's
attention output to layer i's inputs, the last one to the final hidden states. A replay runs
graph 0, then attention eagerly on the real batch (its metadata planned once, as for an eager
forward), copies the result into the static buffer graph 1 reads, and so on.

Padding tokens (bucket larger than the batch) compute token 0 at position 0 and write their K/V
into slot 0, the padding page, as decode graphs' padding rows do; attention never sees them (it
runs on the real tokens only) and their hidden states are never read.

The model must split its forward into ``forward_hidden`` (tokens to final hidden states,
touching no host-side list of the batch) and ``compute_logits`` (``CausalLM``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

_IDS, _POS, _LOC = range(3)  # rows of the static token description


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts captured: steps of 64 from 128 to 512 (prefill chunks, and mixed steps: a
    chunk plus the running requests), coarser beyond; each bucket's graphs keep their own q/k/v
    buffers (the attention outputs share one buffer per layer), so the list stays short."""
    sizes = [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048]
    return sorted({b for b in sizes if b < max_tokens} | {max_tokens})


@dataclass
class _AttentionCall:
    """One attention call between two graphs: its inputs (outputs of the graph before) and the
    static buffer the graph after reads its result from."""

    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    layer: object
    save_kv: bool
    out: torch.Tensor


class _Splitter:
    """The attention backend a forward sees while it is captured: each call ends the graph being
    captured, records the call, and begins the next graph."""

    def __init__(self, pool, num_tokens: int, outs: list[torch.Tensor]) -> None:
        self.pool = pool
        self.num_tokens = num_tokens
        # attention outputs by call, shared by every bucket (at most one bucket runs at a time):
        # the first, largest bucket allocates them
        self.outs = outs
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self._graph = None

    def forward(self, q, k, v, layer, batch, save_kv: bool = True) -> torch.Tensor:
        self.end()
        i = len(self.calls)
        if i == len(self.outs):  # allocated between captures: a buffer at a fixed address
            width = layer.num_heads * layer.head_dim
            self.outs.append(torch.empty(q.shape[0], width, dtype=q.dtype, device=q.device))
        out = self.outs[i][: q.shape[0]]
        self.calls.append(_AttentionCall(q, k, v, layer, save_kv, out))
        self.begin()
        return out


class PiecewiseGraphRunner:
    """``forward_hidden(input_ids, positions, batch)``: the model's forward up to its final
    hidden states; ``attach(batch)``: the batch with the KV pools and ``backend`` attached;
    ``context_len``: the longest sequence (the request-to-token table's width)."""

    def __init__(
        self,
        forward_hidden: Callable[[torch.Tensor, torch.Tensor, ForwardBatch], torch.Tensor],
        attach: Callable[[ForwardBatch], ForwardBatch],
        backend,
        device: torch.device,
        context_len: int,
        max_tokens: int,
    ) -> None:
        self.forward_hidden = forward_hidden
        self.context_len = context_len
        self.attach = attach
        self.backend = backend
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        # input ids, positions and KV slots of the bucket's tokens; padding: zeros
        self.static = torch.zeros(3, self.max_tokens, dtype=torch.int64, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_AttentionCall]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._outs: list[torch.Tensor] = []
        with torch.inference_mode():
            for n in reversed(self.buckets):  # largest first: smaller ones reuse its pool
                self._capture(n)
        logger.info("captured piecewise CUDA graphs for extend batches of %s tokens", self.buckets)

    def _batch(self, n: int, real: ForwardBatch | None = None) -> ForwardBatch:
        """A batch over the first ``n`` static tokens: ``real``'s layout, or (capture and
        warm-up) requests of new tokens in request row 0, none longer than the context."""
        ids, pos, loc = (row[:n] for row in self.static)
        if real is not None:
            real.input_ids, real.positions, real.out_cache_loc = ids, pos, loc
            return real
        lens = [min(self.context_len, n - start) for start in range(0, n, self.context_len)]
        dev = ids.device
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(lens),
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_pool_indices=torch.zeros(len(lens), dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(lens),
            extend_seq_lens_cpu=lens,
        )
        return self.attach(batch)

    def _capture(self, n: int) -> None:
        batch = self._batch(n)
        for _ in range(2):  # compile kernels and settle the allocator outside the graphs
            self.backend.init_forward_metadata(batch)
            self.forward_hidden(batch.input_ids, batch.positions, batch)
        torch.cuda.synchronize()
        splitter = _Splitter(self.pool, n, self._outs)
        batch.attn_backend = splitter
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            splitter.begin()
            hidden = self.forward_hidden(batch.input_ids, batch.positions, batch)
            splitter.end()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graphs[n], self.calls[n], self.outputs[n] = splitter.graphs, splitter.calls, hidden

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, packed: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states ``[num_tokens, hidden]`` of an extend batch: ``packed`` holds
        its input ids, positions and KV slots (``[3, num_tokens]`` on the device), ``batch``
        its layout (the per-request lists and tensors; its token tensors are set here)."""
        n = packed.shape[1]
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.static[:, :n].copy_(packed)
        if bucket > n:
            self.static[:, n:bucket].zero_()
        batch = self._batch(n, batch)
        backend = self.backend
        backend.init_forward_metadata(batch)
        graphs = self.graphs[bucket]
        for graph, call in zip(graphs, self.calls[bucket], strict=False):
            graph.replay()
            k = call.k[:n] if call.k is not None else None
            v = call.v[:n] if call.v is not None else None
            out = backend.forward(call.q[:n], k, v, call.layer, batch, save_kv=call.save_kv)
            call.out[:n].copy_(out)
        graphs[-1].replay()
        return self.outputs[bucket][:n]
