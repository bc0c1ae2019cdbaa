"""The ``flash_attention`` backend: PyTorch's own fused SDPA kernels for prefill, Loom's Triton
kernel for decode.

Prefill (extend) runs the whole batch in one ``torch.nn.functional.scaled_dot_product_attention``
call: the requests' new tokens padded to the longest extend, their KV (cached prefix and new
tokens) gathered from the paged pool padded to the longest sequence, and one boolean mask that
keeps each query on its own request's keys, causally after its prefix (key ``j`` is visible to
query ``i`` of request ``b`` when ``j < seq_b`` and ``j <= prefix_b + i``). With a mask, CUDA
dispatches it to PyTorch's memory-efficient kernel (``is_causal`` alone is top-left aligned,
wrong for a cached prefix, and cannot separate requests). Padded query rows are dropped from the
output; padded keys read the padding page through slot 0 and are masked. Decode uses Loom's
Triton split-KV kernel, which reads the paged pool directly and is CUDA-graph safe; PyTorch has
no paged-KV flash kernel. It also takes an extend batch's trailing one-token rows (a mixed
step's decoding requests), which would otherwise pad every request's query rows to the longest
extend and its keys to the longest sequence.

Layers with a sliding window or a logit soft cap take the Triton extend kernel instead of SDPA
(both are Triton's arguments, so this backend's ``features`` are Triton's). SDPA has no soft
cap, so capped scores would need an explicit fp32 ``[bs, heads, max_ext, max_seq]`` product; and
a window as an SDPA mask would still gather and multiply every key of the padded sequence, where
the Triton kernel starts each query block's KV loop at its window (O(window) a query, not
O(seq_len)), with no mask per distinct window to build and keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.layers.attention.triton_backend import TritonAttnBackend


@dataclass
class _ExtendLayout:
    """One extend batch's padded layout, shared by every layer's forward."""

    kv_slots: torch.Tensor  # [bs, max_seq]: each request's slots, slot 0 past its length
    q_rows: torch.Tensor  # [bs, max_ext]: each padded query row's token (clamped in range)
    mask: torch.Tensor  # [bs, 1, max_ext, max_seq] bool: keys a query sees
    valid: torch.Tensor  # [num_tokens]: the padded rows that are real tokens, in token order


class FlashAttentionBackend(TritonAttnBackend):
    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        return 20 if device.type == "cuda" else None

    def prepare_host(self, batch):
        md = super().prepare_host(batch)
        if not batch.is_decode and md.num_extend_reqs:
            md.layout = self._layout(batch, md.num_extend_reqs)
        return md

    @staticmethod
    def _layout(batch, k: int) -> _ExtendLayout:
        """The padded layout of the batch's first ``k`` requests (the trailing one-token rows
        after them take the decode kernel, ``TritonAttnBackend.forward_extend``)."""
        dev = batch.input_ids.device
        prefix = torch.tensor(batch.extend_prefix_lens_cpu[:k], dtype=torch.int64)
        ext = torch.tensor(batch.extend_seq_lens_cpu[:k], dtype=torch.int64)
        seq = prefix + ext
        max_ext, max_seq = int(ext.max()), int(seq.max())
        starts = torch.cumsum(ext, 0) - ext
        i = torch.arange(max_ext).unsqueeze(0)  # query position within the extend
        j = torch.arange(max_seq).unsqueeze(0)  # key position within the sequence
        q_valid = i < ext.unsqueeze(1)  # [bs, max_ext]
        q_rows = (starts.unsqueeze(1) + i).clamp(max=int(ext.sum()) - 1)
        mask = (j.unsqueeze(1) <= (prefix.unsqueeze(1) + i).unsqueeze(2)) & (
            j < seq.unsqueeze(1)
        ).unsqueeze(1)  # [bs, max_ext, max_seq]
        mask &= q_valid.unsqueeze(2) | (j == 0).unsqueeze(1)  # padded rows: key 0 (no NaN)
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices[:k]
        kv_slots = table.index_select(0, rows)[:, :max_seq]
        kv_slots = kv_slots.masked_fill(~(j < seq.unsqueeze(1)).to(dev), 0)
        return _ExtendLayout(
            kv_slots=kv_slots,
            q_rows=q_rows.to(dev, non_blocking=True),
            mask=mask.unsqueeze(1).to(dev, non_blocking=True),
            valid=q_valid.reshape(-1).nonzero().squeeze(1).to(dev, non_blocking=True),
        )

    def forward_extend(self, q, layer, batch):
        if layer.sliding_window or layer.logit_cap:
            return super().forward_extend(q, layer, batch)
        md = batch.attn_metadata
        k, t = md.num_extend_reqs, md.num_extend_tokens
        if k == batch.batch_size:
            return self._sdpa_extend(q, layer, batch)
        heads, dim = layer.num_heads, layer.head_dim
        out = torch.empty(q.shape[0], heads * dim, dtype=q.dtype, device=q.device)
        if k:
            out[:t] = self._sdpa_extend(q[:t], layer, batch)
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        self._decode_rows(
            q[t:].view(-1, heads, dim), k_buf, v_buf, layer, batch, out[t:].view(-1, heads, dim)
        )
        return out

    def _sdpa_extend(self, q, layer, batch):
        """One SDPA call over the requests of the layout (all but trailing one-token rows)."""
        lay: _ExtendLayout = batch.attn_metadata.layout
        pool = batch.kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        heads, dim = layer.num_heads, layer.head_dim
        bs, max_ext = lay.q_rows.shape
        qp = q.view(-1, heads, dim).index_select(0, lay.q_rows.reshape(-1))
        qp = qp.view(bs, max_ext, heads, dim).transpose(1, 2)
        k = pool.gather(k_buf, lay.kv_slots).to(q.dtype).transpose(1, 2)
        v = pool.gather(v_buf, lay.kv_slots).to(q.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qp,
            k,
            v,
            attn_mask=lay.mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        o = o.transpose(1, 2).reshape(bs * max_ext, heads * dim)
        return o.index_select(0, lay.valid)
