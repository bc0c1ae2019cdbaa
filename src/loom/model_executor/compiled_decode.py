"""Decode steps compiled with torch.compile (``--enable-torch-compile``), for the steps that run
eagerly: on the CPU, and on CUDA without graphs.

An eager decode step of a small model is mostly per-op overhead: the default model's 30 layers
cost ~25 small ops each (norms, rotary, residual adds, views) around their four matmuls and the
attention call. Inductor fuses each run of small ops into one C++ loop and leaves the matmuls
and the attention kernel to ATen, so a step becomes about ten calls a layer.

What keeps one compiled graph valid for every step:
- the attention backend plans outside the graph (``init_forward_metadata``) and its decode
  forward reads sizes from tensors, never from the batch's Python ints
  (``AttentionBackend.supports_torch_compile``), so sequence length and batch size are
  symbolic: one graph serves batch 1 and one every larger batch (Dynamo specialises a size of
  1), both compiled at start-up;
- the modules' attributes are fixed once the model is loaded (a weight update copies into the
  same tensors), so Dynamo's guards on them are skipped: with them, checking ~1,500 guards cost
  1.3 ms of a 15 ms step on the CPU machine (measured), against 0.3 ms without;
- batches with a LoRA adapter never reach it (the runner refuses the flag with LoRA on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from loom.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class CompiledDecode:
    """``forward(input_ids, positions, batch)``: the model's forward, compiled; ``plan(batch)``:
    the attention backend's planning of a batch (run eagerly before each call); ``attach``:
    the batch with the KV pools and the backend attached."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        plan: Callable[[ForwardBatch], None],
        attach: Callable[[ForwardBatch], ForwardBatch],
        max_bs: int,
    ) -> None:
        self.compiled = torch.compile(
            forward,
            dynamic=True,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe},
        )
        self.plan = plan
        self.attach = attach
        self.max_bs = max_bs

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.attach(batch)
        self.plan(batch)
        return self.compiled(batch.input_ids, batch.positions, batch)

    def warm_up(self, device: torch.device) -> None:
        """Compile the graphs before the first request: batch 1 and, if allowed, batch 2 (which
        serves every larger one). The dummy rows decode token 0 at position 1 from
        req-to-token row 0 into slot 0, the padding page (no request exists yet)."""
        for bs in sorted({1, min(2, self.max_bs)}):
            start = time.perf_counter()
            with torch.inference_mode():  # as the runner's tensors are (Dynamo guards on it)
                self._run_dummy(bs, device)
            logger.info(
                "compiled the decode step for batch %s in %.1f s",
                "1" if bs == 1 else f"2..{self.max_bs}",
                time.perf_counter() - start,
            )

    def _run_dummy(self, bs: int, device: torch.device) -> None:
        def full(value: int) -> torch.Tensor:  # a tensor each: Dynamo guards on aliasing
            return torch.full((bs,), value, dtype=torch.int64, device=device)

        self.run(
            ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                batch_size=bs,
                input_ids=full(0),
                positions=full(1),
                out_cache_loc=full(0),
                req_pool_indices=full(0),
                seq_lens=full(2),
                seq_lens_cpu=[2] * bs,
            )
        )
