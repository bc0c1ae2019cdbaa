"""Plain-PyTorch attention over the paged KV pool: the oracle every faster backend is tested
against. Extend runs one SDPA per request (clear, and prefill is compute-bound anyway); decode is
batched: each request's KV is gathered into a padded ``[batch, max_len]`` view and masked.
Sliding windows narrow the masks per layer; soft-capped layers compute their scores explicitly
(SDPA has no cap)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.layers.attention.base import ATTENTION_FEATURES, AttentionBackend


@dataclass
class _ExtendItem:
    q_start: int
    q_len: int
    prefix_len: int
    kv_indices: torch.Tensor  # [seq_len] slots of the request's whole KV


@dataclass
class _Metadata:
    extend: list[_ExtendItem] | None = None
    kv_indices: torch.Tensor | None = None  # decode: [batch, max_len]
    mask: torch.Tensor | None = None  # decode: [batch, 1, 1, max_len]
    key_pos: torch.Tensor | None = None  # decode: [1, max_len] positions of the keys
    max_len: int = 0


def _extend_mask(prefix: int, q_len: int, window: int, device) -> torch.Tensor | None:
    """[q_len, prefix + q_len] bool: causal after the cached prefix, within ``window``; None
    when plain causal attention over the new tokens alone is the answer (SDPA's is_causal)."""
    if prefix == 0 and not window:
        return None
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + prefix
    k_pos = torch.arange(prefix + q_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    return mask


def _attend(q, k, v, mask, layer, is_causal: bool = False) -> torch.Tensor:
    """q ``[b, heads, q_len, dim]``, k / v ``[b, kv_heads, kv_len, dim]``, mask bool
    (broadcastable to ``[b, heads, q_len, kv_len]``) or None."""
    gqa = layer.num_heads != layer.num_kv_heads
    if not layer.logit_cap:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=layer.scaling, enable_gqa=gqa
        )
    if gqa:
        rep = layer.num_heads // layer.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * layer.scaling
    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    if is_causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class TorchNativeAttnBackend(AttentionBackend):
    features = frozenset(ATTENTION_FEATURES)
    supports_torch_compile = True

    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        return 10  # runs everywhere: the last resort on a GPU, the only choice on a CPU

    def prepare_host(self, batch):
        md = _Metadata()
        if batch.is_decode:
            md.max_len = max(batch.seq_lens_cpu)
            return md
        table = batch.req_to_token_pool.req_to_token
        items, start = [], 0
        pool_idx = batch.req_pool_indices.tolist()
        for i, (prefix, ext) in enumerate(
            zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True)
        ):
            items.append(_ExtendItem(start, ext, prefix, table[pool_idx[i], : prefix + ext]))
            start += ext
        md.extend = items
        return md

    def prepare_device(self, batch, md):
        if not batch.is_decode:
            return
        table = batch.req_to_token_pool.req_to_token
        md.key_pos = torch.arange(md.max_len, device=table.device).unsqueeze(0)
        valid = md.key_pos < batch.seq_lens.unsqueeze(1)
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
            mask = _extend_mask(item.prefix_len, item.q_len, layer.sliding_window, q.device)
            o = _attend(
                qi.transpose(0, 1).unsqueeze(0),
                ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0),
                mask,
                layer,
                is_causal=mask is None,
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
        # sizes from the tensors, not the batch's ints: a compiled decode step
        # (--enable-torch-compile) then serves every batch size and length with one graph
        bs, max_len = md.kv_indices.shape
        k = pool.gather(k_buf, md.kv_indices).float().transpose(1, 2)  # [bs, kvh, len, dim]
        v = pool.gather(v_buf, md.kv_indices).float().transpose(1, 2)
        mask = md.mask
        if layer.sliding_window:
            start = (batch.seq_lens - layer.sliding_window).unsqueeze(1)
            mask = mask & (md.key_pos >= start).view(bs, 1, 1, max_len)
        o = _attend(q.float().view(bs, layer.num_heads, 1, layer.head_dim), k, v, mask, layer)
        return o.view(bs, layer.num_heads * layer.head_dim).to(q.dtype)
