"""Mixture-of-experts layers: top-k routing (``router``) and the experts of a sparse MoE block
as one fused module (``fused_moe``; its Triton kernels in ``triton_moe``, imported on first
use)."""

from loom.layers.moe.fused_moe import FusedMoE, checkpoint_mapping, fused_experts_torch
from loom.layers.moe.router import TopKRouting, select_experts

__all__ = ["FusedMoE", "TopKRouting", "checkpoint_mapping", "fused_experts_torch", "select_experts"]
