"""The quantization family (``--quantization``): how linear layers store and multiply weights.

A member is a :class:`QuantizationConfig`, built once per model from what it needs (the model's
path and HF config): :meth:`QuantizationConfig.linear_method` answers, for each linear layer by
its module name, a :class:`LinearMethod` or None (the layer stays dense). After the model is
built, :func:`apply_quantization` gives each chosen layer its method, which replaces the layer's
dense ``weight`` with its own parameters. Those parameters keep the layers' weight loaders:
loaders hand a quantized layer checkpoint tensors in the method's stored form (``load_form``),
and the packed layers' loaders place each shard (q/k/v, gate/up, a tensor-parallel slice) by
rows and columns of that form, so a method must store a weight as ``[out_features, ...]`` rows.
A row-parallel layer's tensor-parallel slice cuts the input: a parameter whose columns are not
input elements (packed codes, per-block scales) carries ``input_columns``
(:func:`column_cut`), which maps the cut to its columns or refuses one inside a block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def column_cut(block: int, block_columns: int, what: str):
    """A parameter's ``input_columns``, for a weight whose rows store each ``block`` input
    elements in ``block_columns`` columns: the input elements ``[start, start + size)`` as its
    columns ``(first, count)``, or a ValueError naming ``what`` for a cut inside a block."""

    def cut(start: int, size: int) -> tuple[int, int]:
        if start % block or size % block:
            raise ValueError(
                f"tensor parallelism splits a layer's input at [{start}, {start + size}), "
                f"inside {what}'s blocks of {block} weights"
            )
        return start // block * block_columns, size // block * block_columns

    return cut


class LinearMethod(ABC):
    """One linear layer's weight storage and matmul."""

    # Whether :meth:`apply` can be captured in a CUDA graph (no host syncs, no shapes that
    # depend on the data): a model with any layer that cannot runs eagerly on CUDA.
    cuda_graph_safe: bool = True

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace ``layer.weight`` (dense, ``[out, in]``, never written) with this method's
        parameters, each carrying ``weight_loader = layer.weight_loader``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Convert the loaded parameters to the form :meth:`apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[tokens, in]``, in ``x``'s dtype."""


class QuantizationConfig(ABC):
    """A member of the quantization family. ``name`` is its ``--quantization`` name."""

    name: str = ""

    @classmethod
    @abstractmethod
    def from_model(cls, model_path: str, hf_config: Any) -> QuantizationConfig:
        """The configuration for the model at ``model_path``; raises ValueError naming what the
        model lacks for this method."""

    @classmethod
    def detects(cls, model_path: str, hf_config: Any) -> bool:
        """Whether the checkpoint at ``model_path`` is stored in this member's format, so that
        it is picked without ``--quantization`` (default: never)."""
        return False

    @abstractmethod
    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        """The method of the linear layer named ``prefix`` (``model.layers.0.mlp.down_proj``)
        whose weight is loaded from the checkpoint tensors ``sources`` (its parts, for a packed
        layer: ``...q_proj.weight``, ``...k_proj.weight``, ...), or None to keep it dense."""

    def load_form(self, name: str) -> bool:
        """Whether the loader should hand checkpoint tensor ``name`` over in this method's
        stored form rather than as dense values."""
        return False

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs as the model's ``load_weights`` takes them (the
        safetensors and pt loaders pass theirs through here): a member whose format stores one
        weight as several tensors regroups them into its parameters' (default: as stored)."""
        return weights

    def apply(self, model: nn.Module) -> int:
        """Give each linear layer of ``model`` its method (the loaders call this on the model
        they build); returns how many got one."""
        from loom.layers.linear import LinearBase

        packed = getattr(model, "packed_modules_mapping", {}) or {}
        count = 0
        for prefix, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            parent, _, leaf = prefix.rpartition(".")
            parts = [leaf] + [name for name, _ in packed.get(leaf, [])]
            sources = [f"{parent}.{part}.weight" if parent else f"{part}.weight" for part in parts]
            method = self.linear_method(prefix, sources)
            if method is not None:
                module.quant_method = method
                method.create_weights(module)
                count += 1
        return count
