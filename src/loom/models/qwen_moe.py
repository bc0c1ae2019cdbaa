"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 whose sparse layers (every ``decoder_sparse_step``-th,
except ``mlp_only_layers``) route each token to ``num_experts_per_tok`` of ``num_experts``
experts (renormalised when ``norm_topk_prob``); Qwen2-MoE adds a sigmoid-gated shared expert."""

from __future__ import annotations

from typing import Any

from torch import nn

from loom.models.decoder import DecoderSpec
from loom.models.moe import MoEDecoderForCausalLM, SparseMoeBlock


def _is_sparse(config: Any, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


class Qwen2MoeForCausalLM(MoEDecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True)

    def build_mlp(self, config: Any, layer_id: int) -> nn.Module:
        if not _is_sparse(config, layer_id):
            return super().build_mlp(config, layer_id)
        return SparseMoeBlock(
            config,
            config.num_experts,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )


class Qwen3MoeForCausalLM(MoEDecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True)

    def build_mlp(self, config: Any, layer_id: int) -> nn.Module:
        if not _is_sparse(config, layer_id):
            return super().build_mlp(config, layer_id)
        return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size)
