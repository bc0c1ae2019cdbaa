"""The ``flash_attention`` backend: PyTorch's own fused SDPA kernels where they fit.

Honestly described: prefill (extend) calls ``torch.nn.functional.scaled_dot_product_attention``
per request in the model's dtype, which on CUDA dispatches to PyTorch's FlashAttention-2 kernel
when the request has no cached prefix (plain causal) and to the memory-efficient kernel with an
explicit mask when it has one (PyTorch's ``is_causal`` is top-left aligned, wrong for a prefix).
Decode uses Loom's Triton split-KV kernel, which reads the paged pool directly and is CUDA-graph
safe; PyTorch has no paged-KV flash kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.layers.attention.triton_backend import TritonAttnBackend


class FlashAttentionBackend(TritonAttnBackend):
    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        return super().is_supported(device)

    def forward_extend(self, q, layer, batch):
        pool = batch.kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.tolist()
        out = torch.empty(
            q.shape[0], layer.num_heads * layer.head_dim, dtype=q.dtype, device=q.device
        )
        start = 0
        for row, prefix, ext in zip(
            rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu, strict=True
        ):
            seq = prefix + ext
            idx = table[row, :seq]
            qi = q[start : start + ext].view(ext, layer.num_heads, layer.head_dim).transpose(0, 1)
            ki = pool.gather(k_buf, idx).to(q.dtype).transpose(0, 1)
            vi = pool.gather(v_buf, idx).to(q.dtype).transpose(0, 1)
            mask = None
            if prefix:
                q_pos = torch.arange(ext, device=q.device).unsqueeze(1) + prefix
                mask = torch.arange(seq, device=q.device).unsqueeze(0) <= q_pos
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0),
                ki.unsqueeze(0),
                vi.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[start : start + ext] = o[0].transpose(0, 1).reshape(ext, -1)
            start += ext
        return out
