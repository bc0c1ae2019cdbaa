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
- on the CPU the graph's calls are made from C++ (Inductor's ``cpp_wrapper``): a default-model
  decode step 6.5 against 8.5 ms with Inductor's Python wrapper, for ~50 s more compiling
  (measured on the CPU machine, GGUF blocks);
- batches with a LoRA adapter never reach it (``ServerArgs`` refuses the flag with LoRA, and
  with tensor parallelism).
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable

import torch

from loom.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


_instances = 0
# the dummy steps' sequence length: equal to no other size the trace sees
WARM_UP_LEN = 13


def _call(forward, input_ids, positions, batch):
    return forward(input_ids, positions, batch)


class CompiledDecode:
    """``forward(input_ids, positions, batch)``: the model's forward, compiled; ``plan(batch)``:
    the attention backend's planning of a batch (run eagerly before each call); ``attach``:
    the batch with the KV pools and the backend attached; ``fixed``: the tensors every step
    reads whose sizes never change (the KV pool's buffers, the req-to-token table), marked
    static so that Dynamo neither guards their sizes nor equates them with a batch's."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        plan: Callable[[ForwardBatch], None],
        attach: Callable[[ForwardBatch], ForwardBatch],
        fixed: list[torch.Tensor],
        max_bs: int,
        cpp_wrapper: bool = False,
    ) -> None:
        for t in fixed:
            torch._dynamo.mark_static(t)
        # Dynamo keeps compiled graphs on the traced function's code object, and with the
        # module guards skipped nothing tells two models apart: each instance traces a code
        # object of its own, so another engine's model in this process never reuses its graphs.
        global _instances
        _instances += 1
        code = _call.__code__.replace(co_name=f"compiled_decode_{_instances}")
        own = types.FunctionType(code, _call.__globals__, code.co_name)
        self.compiled = torch.compile(
            functools.partial(own, forward),
            dynamic=True,
            options={
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                "cpp_wrapper": cpp_wrapper,
            },
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

    def warm_up(self, decode: Callable[[int, int], None]) -> None:
        """Compile the graphs before the first request: ``decode(bs, seq_len)`` runs a dummy
        decode step through the runner, batch 1 and, if allowed, batch 2 (which serves every
        larger one). The length differs from every size the trace sees (Dynamo would take
        two equal sizes for one symbol, and guard that they stay equal)."""
        for bs in sorted({1, min(2, self.max_bs)}):
            start = time.perf_counter()
            decode(bs, WARM_UP_LEN)
            logger.info(
                "compiled the decode step for batch %s in %.1f s",
                "1" if bs == 1 else f"2..{self.max_bs}",
                time.perf_counter() - start,
            )
