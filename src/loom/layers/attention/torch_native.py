"""Plain-PyTorch attention over the paged KV pool: the oracle every faster backend is tested
against. Extend runs one SDPA per request (clear, and prefill is compute-bound anyway); decode is
batched: each request's KV is gathered into a padded ``[batch, max_len]`` view and masked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.layers.attention.base import AttentionBackend


@dataclass
class _ExtendItem:
    q_start: int
    q_len: int
    kv_indices: torch.Tensor  # [seq_len] slots of the request's whole KV
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when there is no cached prefix


@dataclass
class _Metadata:
    extend: list[_ExtendItem] | None = None
    kv_indices: torch.Tensor | None = None  # decode: [batch, max_len]
    mask: torch.Tensor | None = None  # decode: [batch, 1, 1, max_len]
    max_len: int = 0


class TorchNativeAttnBackend(AttentionBackend):
    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        return 10  # runs everywhere: the last resort on a GPU, the only choice on a CPU

    def prepare_host(self, batch):
        md = _Metadata()
        if batch.is_decode:
            md.max_len = max(batch.seq_lens_cpu)
            return md
        table = batch.req_to_token_pool.req_to_token
        device = table.device
        items, start = [], 0
        pool_idx = batch.req_pool_indices.tolist()
        for i, (prefix, ext) in enumerate(
            zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True)
        ):
            seq_len = prefix + ext
            mask = None
            if prefix > 0:
                q_pos = torch.arange(ext, device=device).unsqueeze(1) + prefix
                mask = torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos
            items.append(_ExtendItem(start, ext, table[pool_idx[i], :seq_len], mask))
            start += ext
        md.extend = items
        return md

    def prepare_device(self, batch, md):
        if not batch.is_decode:
            return
        table = batch.req_to_token_pool.req_to_token
        arange = torch.arange(md.max_len, device=table.device)
        valid = arange.unsqueeze(0) < batch.seq_lens.unsqueeze(1)
        # Past seq_len, read the zeroed padding slot 0 instead of stale slots.
        md.kv_indices = table[batch.req_pool_indices, : md.max_len].masked_fill(~valid, 0)
        md.mask = valid.view(batch.batch_size, 1, 1, md.max_len)

    def forward_extend(self, q, layer, batch):
        md: _Metadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        out = torch.empty(
            q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device
        )
        for item in md.extend:
            qi = q[item.q_start : item.q_start + item.q_len].view(
                item.q_len, layer.num_heads, layer.head_dim
            )
            ki = batch.kv_pool.gather(k_buf, item.kv_indices).to(q.dtype)
            vi = batch.kv_pool.gather(v_buf, item.kv_indices).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1).unsqueeze(0),
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=item.mask,
                is_causal=item.mask is None,
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[item.q_start : item.q_start + item.q_len] = (
                o[0].transpose(0, 1).reshape(item.q_len, -1)
            )
        return out

    def forward_decode(self, q, layer, batch):
        # SDPA in fp32 (upcasting bf16/fp16): on CPU its bf16 kernel is ~5x slower than the
        # upcast for q_len == 1 (measured), and fp32 keeps the oracle exact.
        md: _Metadata = batch.attn_metadata
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        pool = batch.kv_pool
        bs = batch.batch_size
        k = pool.gather(k_buf, md.kv_indices).float().transpose(1, 2)  # [bs, kvh, len, dim]
        v = pool.gather(v_buf, md.kv_indices).float().transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.float().view(bs, layer.num_heads, 1, layer.head_dim),
            k,
            v,
            attn_mask=md.mask,
            scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        )
        return o.view(bs, layer.num_heads * layer.head_dim).to(q.dtype)
