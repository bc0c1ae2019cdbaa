"""What Loom's mixture-of-experts architectures share: the sparse block (a router, the experts
as one ``FusedMoE``, optionally a gated shared expert) and a decoder whose layers take it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.layers.linear import ReplicatedLinear
from loom.layers.moe import FusedMoE, TopKRouting
from loom.model_loader.weight_utils import live
from loom.models.decoder import DecoderForCausalLM, GatedMLP


class SparseMoeBlock(nn.Module):
    """``experts(x)`` routed top-k by ``gate`` (HF's rule for the config's model type), plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when ``shared_intermediate_size``."""

    def __init__(
        self,
        config: Any,
        num_experts: int,
        intermediate_size: int,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)
        self.routing = TopKRouting.from_config(config)
        self.experts = FusedMoE(num_experts, hidden, intermediate_size)
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden, shared_intermediate_size, config.hidden_act)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(x))
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderForCausalLM(DecoderForCausalLM):
    """A decoder whose sparse layers' MLPs are :class:`SparseMoeBlock` (``build_mlp``); the
    experts' checkpoint tensors load through ``FusedMoE``'s own loader."""

    # a checkpoint's name of the block -> the model's (Mixtral: block_sparse_moe)
    block_name: str = "mlp"

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        experts: dict[str, tuple[str, int | None, str]] = {}
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                prefix = f"model.layers.{i}.mlp.experts"
                for ckpt, param, e, shard in layer.mlp.experts.checkpoint_mapping(prefix):
                    experts[ckpt] = (param, e, shard)
        params = dict(self.named_parameters())
        block = f".{self.block_name}."
        for name, tensor in weights:
            name = name.replace(block, ".mlp.")
            hit = experts.get(name)
            if hit is None:
                yield name, tensor
                continue
            param_name, expert_id, shard_id = hit
            param = live(self, params, param_name)
            param.weight_loader(
                param, tensor.to(param.dtype), shard_id=shard_id, expert_id=expert_id
            )
            loaded.add(param_name)
