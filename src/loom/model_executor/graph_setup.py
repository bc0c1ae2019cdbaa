"""The CUDA graphs a model runner captures once bound: decode graphs for every batch-size
bucket, piecewise extend graphs, and whole mixed-step graphs (``ModelRunner`` inherits these
methods; they read its model, arguments, attention backend and LoRA manager)."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class GraphSetup:
    def capture_graphs(self) -> None:
        """On CUDA, the decode graphs and (where the model splits its forward) the piecewise
        extend graphs and the mixed-step graphs, unless disabled or a layer cannot be
        captured."""
        args = self.args
        if self.device.type != "cuda" or args.disable_cuda_graph:
            return
        if self._uncapturable_layers():
            logger.warning(
                "CUDA graphs off: %s cannot run inside a CUDA graph",
                ", ".join(sorted(self._uncapturable_layers())),
            )
            return
        if self.attn_backend.supports_cuda_graph:
            # Eager decode of a large model costs ~10 ms of host time per step (hundreds of
            # launches), which large batches cannot hide: capture up to the running limit.
            max_bs = args.cuda_graph_max_bs or self.defaults.cuda_graph_max_bs
            self.capture_cuda_graphs(min(max_bs, self.max_running_requests))
            if not args.disable_piecewise_cuda_graph and type(self.model).splits_forward():
                self.capture_piecewise_graphs(args.piecewise_cuda_graph_max_tokens)
            if self._wants_mixed_graphs() and self.attn_backend.supports_mixed_graph:
                self.capture_mixed_graphs(min(max_bs, self.max_running_requests))

    def compile_decode(self) -> None:
        """With --enable-torch-compile, eager decode steps (no CUDA graphs: the CPU, or
        --disable-cuda-graph) of up to --torch-compile-max-bs requests run through
        ``CompiledDecode`` (``ServerArgs`` refuses it with LoRA or tensor parallelism)."""
        from loom.model_executor.compiled_decode import CompiledDecode

        args = self.args
        if not args.enable_torch_compile:
            return
        if self.cuda_graph_runner is not None:
            # (SGLang's launch lines carry the flag: serving goes on with the graphs)
            logger.warning(
                "--enable-torch-compile not applied: CUDA graphs serve decode here (it compiles "
                "decode steps that run eagerly: on the CPU, or with --disable-cuda-graph)"
            )
            return
        if not self.attn_backend.supports_torch_compile:
            raise ValueError(
                "--enable-torch-compile needs a decode attention backend that torch.compile "
                "traces whole (torch_native); pass --decode-attention-backend torch_native"
            )
        max_bs = min(args.torch_compile_max_bs, self.max_running_requests)
        pool = self.kv_pool
        fixed = [*pool.k_buffers, *pool.v_buffers, self.req_to_token_pool.req_to_token]
        self.compiled_decode = CompiledDecode(
            self.model,
            self.attn_backend.init_forward_metadata,
            self._attach,
            fixed,
            max_bs,
            cpp_wrapper=self.device.type == "cpu",
        )
        # dummy rows: token 0 from req-to-token row 0 (no request holds it yet) into slot 0,
        # the padding page
        self.compiled_decode.warm_up(
            lambda bs, seq_len: self.forward_decode(
                [0] * bs, [seq_len - 1] * bs, [0] * bs, [0] * bs
            )
        )

    def _uncapturable_layers(self) -> set[str]:
        """The quantization methods of the model's layers that cannot run inside a CUDA graph
        (``LinearMethod.cuda_graph_safe``); with any, the model runs eagerly, as with
        --disable-cuda-graph."""
        return {
            type(m.quant_method).__name__
            for m in self.model.modules()
            if not getattr(getattr(m, "quant_method", None), "cuda_graph_safe", True)
        }

    def _wants_mixed_graphs(self) -> bool:
        """Whether mixed steps should run as whole CUDA graphs (given a backend that has them)."""
        args = self.args
        return (
            self.device.type == "cuda"
            and args.enable_mixed_chunk
            and not (
                args.disable_cuda_graph
                or args.disable_piecewise_cuda_graph
                or args.disable_mixed_cuda_graph
            )
            and type(self.model).splits_forward()
            and not self._uncapturable_layers()
        )

    def capture_mixed_graphs(self, max_rows: int, capture: bool = True) -> None:
        """Capture the mixed-step graphs: prompt tokens up to the prefill chunk (at most 512)
        beside up to ``max_rows`` decoding rows (``capture`` False: the same layout run
        eagerly, for tests without CUDA)."""
        from loom.model_executor.mixed_graph_runner import MixedGraphRunner

        chunk = self.args.chunked_prefill_size or self.defaults.chunked_prefill_size
        if chunk < 0:
            chunk = 512
        self.mixed_graph_runner = MixedGraphRunner(
            self.model.forward_hidden,
            self._attach,
            self.attn_backend,
            self.device,
            min(chunk, 512),
            max_rows,
            capture=capture,
        )

    def capture_piecewise_graphs(self, max_tokens: int) -> None:
        """Capture the extend graphs of every token-count bucket up to ``max_tokens``."""
        from loom.model_executor.piecewise_graph_runner import PiecewiseGraphRunner

        self.piecewise_graph_runner = PiecewiseGraphRunner(
            self.model.forward_hidden,
            self._attach,
            self.attn_backend,
            self.device,
            self.model_config.context_len,
            max_tokens,
        )

    def capture_cuda_graphs(self, max_bs: int) -> None:
        """Capture the decode graphs of every batch-size bucket up to ``max_bs``."""
        from loom.model_executor.cuda_graph_runner import CudaGraphRunner

        self.cuda_graph_runner = CudaGraphRunner(
            self._run,
            self._attach,
            self.attn_backend,
            self.device,
            self.model_config.context_len,
            max_bs,
            lora=self._graph_lora(),
        )

    def _graph_lora(self):
        """The LoRA manager when its backend runs inside the decode graphs, else None."""
        m = self.lora_manager
        if m is None:
            return None
        probe = torch.full((1,), -1, dtype=torch.int32, device=self.device)
        return m if m.backend.graph_batch(probe) is not None else None
