"""Vocabulary-parallel embedding and LM head (each rank holds a contiguous slice of the vocab)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from loom.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tp_size()
        per_rank = -(-vocab_size // self.tp_size)
        self.start = get_tp_rank() * per_rank
        self.end = min(self.start + per_rank, vocab_size)
        # Padded to the same size on every rank so that gathers line up.
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = loaded[self.start : self.end]
        if shard.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"embedding shape mismatch: {tuple(loaded.shape)} vs {tuple(param.shape)}"
            )
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    # set before loading (``GGUFQuantization.apply``): the logits from an 8-bit copy of the
    # weight, in Q8_0 blocks through Loom's CPU kernel where it runs, else one scale a row
    # through PyTorch's CPU int8 matmul
    int8_head = False

    def process_weights_after_loading(self) -> None:
        from loom.layers.quantization import cpu_blocks

        # The embedding lookup wants rows; the logits GEMV wants the transposed layout, so the
        # head keeps its own copy on CPU fp32 (see relayout_for_cpu_gemv).
        w = self.weight
        self._head_weight = self._head_int8 = self._head_blocks = None
        if self.int8_head and cpu_blocks.available():
            # a head read from a Q8_0 file comes back as the file's blocks
            self._head_blocks = cpu_blocks.quantize_q8_0(w.data)
        elif self.int8_head:
            # rows quantized to int8 by their absolute maximum; the scales in bf16, as the
            # kernel takes them (SmolLM2's Q8_0 head: a decode step 14.0 against 16.3 ms with
            # the fp32 head; top-1 against HF 502 / 512 against 511 / 512)
            scale = w.data.abs().amax(dim=1).clamp(min=1e-12) / 127
            q = torch.round(w.data / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self._head_int8 = (q, scale.to(torch.bfloat16))
        elif w.device.type == "cpu" and w.dtype == torch.float32:
            self._head_weight = w.data.t().contiguous().t()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if getattr(self, "_head_blocks", None) is not None:
            from loom.layers.quantization.cpu_blocks import block_mm

            logits = block_mm(hidden, *self._head_blocks)
        elif getattr(self, "_head_int8", None) is not None:
            q, scale = self._head_int8
            h = hidden.reshape(-1, hidden.shape[-1]).to(torch.bfloat16)
            logits = torch._weight_int8pack_mm(h, q, scale).to(hidden.dtype)
            logits = logits.reshape(*hidden.shape[:-1], -1)
        else:
            head = getattr(self, "_head_weight", None)
            logits = linear(hidden, self.weight if head is None else head)
        if self.tp_size > 1:
            logits = tp_all_gather(logits)
        return logits[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection (``compute_logits``); a tied model uses its embedding instead."""
