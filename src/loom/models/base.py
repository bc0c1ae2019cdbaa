"""The model family: one class per HF architecture name (``config.architectures[0]``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from loom.forward_batch import ForwardBatch


class CausalLM(nn.Module, ABC):
    """A causal language model built from Loom's layers.

    Contract:
    - ``__init__(config)`` takes the HF ``PretrainedConfig``; parameters may be left uninitialised
      (a loader fills every one of them).
    - ``forward(input_ids, positions, batch)`` takes the flattened tokens of a batch and returns
      logits ``[batch.batch_size, vocab_size]`` in float32 for each request's last new token.
    - Optionally, ``forward`` split in two: ``forward_hidden(input_ids, positions, batch)`` (the
      final hidden states of every token, reading no host-side list of the batch) and
      ``compute_logits(hidden, batch)``. A model that has them runs its extend batches as
      piecewise CUDA graphs (``model_executor/piecewise_graph_runner.py``).
    - ``load_weights(weights)`` consumes ``(hf_name, full_tensor)`` pairs in HF naming; packed
      parameters are described by ``packed_modules_mapping`` (fused name -> checkpoint names) and
      every parameter's ``weight_loader`` does its own tensor-parallel slicing.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def splits_forward(cls) -> bool:
        """Whether the model has ``forward_hidden`` and ``compute_logits``."""
        return (
            cls.forward_hidden is not CausalLM.forward_hidden
            and cls.compute_logits is not CausalLM.compute_logits
        )

    @classmethod
    def kv_cache_shape(cls, config: Any) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache this model needs (before TP)."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return config.num_hidden_layers, num_kv, head_dim
