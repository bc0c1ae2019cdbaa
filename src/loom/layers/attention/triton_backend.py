"""The ``triton`` attention backend: Loom's own kernels (``triton_ops.py``) over the paged pool.

Decode reads only device tensors whose shapes depend on the batch size, so it is CUDA-graph
safe. Sliding windows and logit soft caps are kernel arguments read from each layer (constants
of the layer, baked into a captured graph like its scale). On CPU it runs only under
``TRITON_INTERPRET=1`` (tests); ``--attention-backend auto`` picks it on CUDA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from loom import env
from loom.layers.attention.base import ATTENTION_FEATURES, AttentionBackend


def num_kv_splits(bs: int) -> int:
    """Splits of each request's KV in decode: enough programs to fill the GPU, and no more,
    since each split costs a partial output and its merge. 16 up to batch 4, then halving as
    the batch doubles: 8 at batch 8, 4 at 16, 2 at 32, 1 above 32. On the H200 (Llama-3-8B
    heads, bench/attn_micro.py) 16 splits were fastest at batch 1 (6 vs 8 us with 8)
    and 1 split at batch 64, 512 and 1,000 (482 vs 581 us with 8 at 512 x 900 tokens). The
    thresholds are CUDA-graph buckets (powers of two), so a graph and the eager step it pads
    compute the same thing. (bench/attn_micro.py passes other values to the kernel directly.)"""
    splits = 16
    while splits > 1 and bs > 64 // splits:
        splits //= 2
    return splits


def kv_per_program(bs: int, kv_dtype: torch.dtype) -> int:
    """KV heads one decode program reads. Over an fp8 cache a head's row of a token is 128
    bytes, too short a read to keep the loads busy; two heads read as one 256-byte run did
    better once the batch alone fills the GPU (one KV split). On the H200 (Llama-3-8B heads,
    docs/benchmarks.md): 62 vs 77 us at batch 64 x 1,024 tokens (bench/attn_micro.py),
    and the 1000-request workload ran at 11,940 output tok/s against 10,809 with one head (4
    heads: 10,692). At small batches, where the splits fill the GPU, one head was faster (6.0 vs
    6.6 us at batch 1), and over bf16 two heads matched one (70 us at batch 64)."""
    if kv_dtype.itemsize == 1 and num_kv_splits(bs) == 1:
        return 2
    return 1


def decode_prefetch(bs: int, kv_dtype: torch.dtype) -> bool:
    """Whether decode loads the next tile's KV slots while this tile's K/V are in flight
    (triton_ops.decode_attention's ``prefetch``): where two KV heads a program read an fp8
    cache. On the H200 (bench/attn_micro.py --sweep, 512 requests x 850 tokens, Llama-3-8B
    heads) that took 341 vs 374 us a layer, the fastest of 24 tile / warp / stage
    / prefetch combinations (bf16 with one head: 447 us)."""
    return kv_per_program(bs, kv_dtype) > 1


@dataclass
class _Metadata:
    q_start: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    max_extend_len: int = 0
    order: torch.Tensor | None = None  # decode: the batch rows, longest first
    # extend: the requests before the trailing one-token rows (a mixed step's decoding
    # requests), and their tokens; the rows after them take the decode kernel
    num_extend_reqs: int = 0
    num_extend_tokens: int = 0
    # the trailing rows' request rows, sequence lengths and (one KV split) program order, in
    # tensors of their own: as the decode graphs pass them (16-byte aligned, ordered when one
    # split), so the kernel variants their capture compiled serve mixed steps too
    decode_rows: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_order: torch.Tensor | None = None
    # a mixed graph's layout: the extend kernel leaves padding tokens' rows unwritten, so the
    # output starts zeroed (stale values could be NaN and reach an MoE router)
    zero_out: bool = False


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_mixed_graph = True
    features = frozenset(ATTENTION_FEATURES)

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        if importlib.util.find_spec("triton") is None:
            return False
        return device.type == "cuda" or env.triton_interpreter()

    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        """On CUDA, first for decode: it plans nothing on the host (FlashInfer's decode plans
        every step, ~0.5 ms of a host-bound SmolLM2 step on the H200), and over a bf16 cache its
        decode matched FlashInfer's at batch 256 and beat it at 64, 512 and 1,000 (482 vs 506 us
        at 512 x 900 tokens, Llama-3-8B heads); over fp8 the 1000-request workload ran at 11,940
        output tok/s against FlashInfer's 10,297. Second for prefill (see FlashInfer's)."""
        if device.type != "cuda":
            return None
        return 40 if phase == "decode" else 30

    def prepare_host(self, batch):
        md = _Metadata()
        if batch.is_decode:
            return md
        device = batch.input_ids.device
        ext = batch.extend_seq_lens_cpu
        k = len(ext)
        while k > 0 and ext[k - 1] == 1:
            k -= 1
        md.num_extend_reqs, md.num_extend_tokens = k, sum(ext[:k])
        if k < len(ext):
            md.decode_rows = batch.req_pool_indices[k:].clone()
            md.decode_seq_lens = batch.seq_lens[k:].clone()
            if num_kv_splits(len(ext) - k) == 1:
                md.decode_order = torch.argsort(md.decode_seq_lens, descending=True)
        starts = [0]
        for n in ext[:-1]:
            starts.append(starts[-1] + n)
        md.q_start = torch.tensor(starts, dtype=torch.int64).to(device, non_blocking=True)
        md.extend_lens = torch.tensor(ext, dtype=torch.int64).to(device, non_blocking=True)
        md.prefix_lens = torch.tensor(batch.extend_prefix_lens_cpu, dtype=torch.int64).to(
            device, non_blocking=True
        )
        md.max_extend_len = max(ext[:k], default=0)
        return md

    def mixed_graph_metadata(
        self, batch, num_prefill_reqs, num_prefill_tokens, q_start, extend_lens, prefix_lens
    ):
        k = num_prefill_reqs
        md = _Metadata(
            q_start=q_start,
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            max_extend_len=num_prefill_tokens,
            num_extend_reqs=k,
            num_extend_tokens=num_prefill_tokens,
            decode_rows=batch.req_pool_indices[k:],
            decode_seq_lens=batch.seq_lens[k:],
            zero_out=True,
        )
        if num_kv_splits(batch.batch_size - k) == 1:
            md.decode_order = torch.argsort(md.decode_seq_lens, descending=True)
        return md

    def forward_extend(self, q, layer, batch):
        """The extend kernel over the requests with several new tokens; one-token rows at the
        end of the batch (a mixed step's decoding requests, each a query over its whole
        sequence) take the decode kernel, whose split-KV programs read each KV head once for
        its query group: in the extend kernel each such row ran a mostly empty query tile per
        head serially over its context (on the H200, mixed steps of 256 prefill tokens and 64
        decoding requests waited 14 ms for the forward against 4 ms for the prefill alone)."""
        from loom.layers.attention.triton_ops import extend_attention

        md: _Metadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        table = batch.req_to_token_pool.req_to_token
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        k, t = md.num_extend_reqs, md.num_extend_tokens
        if k == batch.batch_size:
            out = extend_attention(
                q3,
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices,
                md.q_start,
                md.extend_lens,
                md.prefix_lens,
                md.max_extend_len,
                layer.scaling,
                window=layer.sliding_window,
                logit_cap=layer.logit_cap,
            )
            return out.view(-1, layer.num_heads * layer.head_dim)
        out = torch.zeros_like(q3) if md.zero_out else torch.empty_like(q3)
        if k:
            out[:t] = extend_attention(
                q3[:t],
                k_buf,
                v_buf,
                table,
                batch.req_pool_indices[:k],
                md.q_start[:k],
                md.extend_lens[:k],
                md.prefix_lens[:k],
                md.max_extend_len,
                layer.scaling,
                window=layer.sliding_window,
                logit_cap=layer.logit_cap,
            )
        self._decode_rows(q3[t:], k_buf, v_buf, layer, batch, out[t:])
        return out.view(-1, layer.num_heads * layer.head_dim)

    @staticmethod
    def _decode_rows(q3, k_buf, v_buf, layer, batch, out) -> None:
        """Decode attention for the batch's trailing one-token rows, one query each."""
        from loom.layers.attention.triton_ops import decode_attention

        md: _Metadata = batch.attn_metadata
        bs = q3.shape[0]
        decode_attention(
            q3,
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            md.decode_rows,
            md.decode_seq_lens,
            layer.scaling,
            num_kv_splits(bs),
            out=out,
            kv_per_program=min(kv_per_program(bs, k_buf.dtype), k_buf.shape[1]),
            prefetch=decode_prefetch(bs, k_buf.dtype),
            order=md.decode_order,
            window=layer.sliding_window,
            logit_cap=layer.logit_cap,
        )

    @staticmethod
    def _decode_order(batch) -> torch.Tensor:
        """The batch's rows longest first, sorted on the device once a forward (by the first
        layer; inside a CUDA graph, by its replay). With one KV split each program's work is
        its request's context, and the GPU takes programs in grid order: in batch order, a
        long row launched last runs alone at the end. Longest first, the last programs are
        the shortest (longest-processing-time-first scheduling)."""
        md = batch.attn_metadata
        if md.order is None:
            md.order = torch.argsort(batch.seq_lens, descending=True)
        return md.order

    def forward_decode(self, q, layer, batch):
        from loom.layers.attention.triton_ops import decode_attention

        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        splits = num_kv_splits(batch.batch_size)
        out = decode_attention(
            q.view(-1, layer.num_heads, layer.head_dim),
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            layer.scaling,
            splits,
            kv_per_program=min(kv_per_program(batch.batch_size, k_buf.dtype), k_buf.shape[1]),
            prefetch=decode_prefetch(batch.batch_size, k_buf.dtype),
            order=self._decode_order(batch) if splits == 1 else None,
            window=layer.sliding_window,
            logit_cap=layer.logit_cap,
        )
        return out.view(-1, layer.num_heads * layer.head_dim)
