"""Mixtral: Mistral whose every MLP is a sparse block of ``num_local_experts`` experts, each token
routed to ``num_experts_per_tok`` of them (softmax, top-k, renormalised)."""

from __future__ import annotations

from typing import Any

from torch import nn

from loom.models.moe import MoEDecoderForCausalLM, SparseMoeBlock


class MixtralForCausalLM(MoEDecoderForCausalLM):
    block_name = "block_sparse_moe"

    def build_mlp(self, config: Any, layer_id: int) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size)
