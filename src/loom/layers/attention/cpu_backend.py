"""``cpu``: decode attention by Loom's C++ kernel over the paged KV pool read in place
(``csrc/paged_decode.cpp``); extend as ``torch_native``.

``torch_native`` decodes by gathering every request's K and V into a padded copy for SDPA: at
batch 64 on the default model that copy is ~19 MB a layer, written and read again each step
(30% of the step, measured). The kernel reads each K and V row once from its slot: the scores
of a KV head's query heads, a softmax in fp32 (its own exp, within 2e-7 relative), the weighted
sum of the values. Sliding windows and logit caps are applied in the kernel. The KV cache in
float32 or bfloat16; the kernel computes in fp32 and returns the model's dtype.
"""

from __future__ import annotations

import functools
import os

import torch

from loom.layers import cpu_ops
from loom.layers.attention.base import ATTENTION_FEATURES, AttentionContext
from loom.layers.attention.torch_native import TorchNativeAttnBackend


@functools.cache
def _build() -> str | None:
    source = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")
    reason = cpu_ops.build("loom_paged_decode", source)
    if reason is not None:
        return reason

    @torch.library.register_fake("loom_cpu_attn::paged_decode")
    def _(q, k_buf, v_buf, table, rows, seq_lens, scale, window, cap):
        return torch.empty_like(q)

    return None


class CPUAttnBackend(TorchNativeAttnBackend):
    features = frozenset(ATTENTION_FEATURES)
    supports_torch_compile = True

    @classmethod
    def is_supported(cls, device: torch.device) -> bool:
        return device.type == "cpu" and _build() is None

    @classmethod
    def auto_priority(cls, device: torch.device, phase: str) -> int | None:
        # the CPU's decode (torch_native's extend is this backend's own)
        return 20 if phase == "decode" and cls.is_supported(device) else None

    def __init__(self, ctx: AttentionContext) -> None:
        super().__init__(ctx)
        if ctx.device.type != "cpu":
            raise ValueError("the cpu attention backend runs on the CPU")
        reason = _build()
        if reason is not None:
            raise ValueError(f"the cpu attention backend cannot run here: {reason}")
        if ctx.kv_pool.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"the cpu attention backend reads a float32 or bfloat16 KV cache, not "
                f"{ctx.kv_pool.dtype}"
            )

    def prepare_device(self, batch, md):
        if not batch.is_decode:
            super().prepare_device(batch, md)

    def forward_decode(self, q, layer, batch):
        k_buf, v_buf = batch.kv_pool.get_kv(layer.layer_id)
        bs = batch.req_pool_indices.shape[0]
        o = torch.ops.loom_cpu_attn.paged_decode(
            q.float().reshape(bs, layer.num_heads, layer.head_dim).contiguous(),
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            float(layer.scaling),
            int(layer.sliding_window or 0),
            float(layer.logit_cap or 0.0),
        )
        return o.view(bs, layer.num_heads * layer.head_dim).to(q.dtype)
