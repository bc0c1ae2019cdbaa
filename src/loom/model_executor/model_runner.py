"""ModelRunner: owns the device, the model, the KV memory and the attention backend, and turns
the scheduler's host-side batches into device tensors and logits."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from loom import plugins
from loom.distributed import get_tp_size
from loom.layers.attention.base import AttentionBackend, AttentionContext
from loom.mem_cache.memory_pool import FP8_DTYPES, KVPool, PageAllocator, ReqToTokenPool
from loom.model_executor.forward_batch import ForwardBatch, ForwardMode
from loom.model_loader.base import DeviceConfig, ModelConfig
from loom.model_loader.model_path import resolve_model_path

if TYPE_CHECKING:
    from loom.config import ServerArgs
    from loom.scheduler.request import Req

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# --attention-backend auto: the first registered, supported backend in this order wins. On the
# H200 (docs/benchmarks.md) FlashInfer 0.7.4 served the 1000-request Llama-3-8B workload at
# 8,081 output tok/s against 2,796 for Loom's Triton kernels, which win only at batch 1
# (5.11 vs 5.35 ms per step): FlashInfer goes first where it imports, Triton otherwise.
_AUTO_BACKENDS = {
    "cuda": ["flashinfer", "triton", "flash_attention", "torch_native"],
    # Decode: Loom's Triton kernels need no per-step host planning, which FlashInfer's decode
    # does (docs/benchmarks.md has both on the H200).
    ("cuda", "decode"): ["triton", "flashinfer", "flash_attention", "torch_native"],
    "cpu": ["torch_native"],
}
# ... except above a decode batch size (a CUDA-graph bucket, so an eager step and the graph that
# pads it agree), where `auto` may decode with another backend when it is available, keyed by
# (device, KV cache kind). No entry now. On the H200 (Llama-3-8B heads, docs/benchmarks.md):
# over a bf16 cache Loom's Triton decode with 1-2 KV splits matched FlashInfer's at batch 256
# and beat it at 64, 512 and 1,000 (482 vs 506 us at 512 x 900 tokens, session 5). Over an
# fp8_e4m3 cache FlashInfer's was faster from batch 64 (474 vs 530 us at 512 x 900, session 5)
# until Triton's read two KV heads a program there (triton_backend.kv_per_program): the
# 1000-request workload then ran at 11,940 output tok/s against FlashInfer's 10,297 (session 7
# and session 5).
_AUTO_DECODE_LARGE: dict[tuple[str, str], tuple[str, int]] = {}
# On the H200 the 1000-request Llama-3-8B workload ran at 10,017 output tok/s with 1024 running
# requests against 9,712 with 512 (docs/benchmarks.md): larger batches prefill in larger steps.
_MAX_AUTO_RUNNING = 1024
_MAX_GRAPH_BS = 1024
_CPU_MAX_AUTO_RUNNING = 512
_CPU_MAX_AUTO_TOKENS = 1 << 18


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, server_args: ServerArgs, loader=None) -> None:
        args = server_args
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        torch.manual_seed(args.random_seed)
        if loader is None:
            loader = plugins.resolve("model_loader", args.load_format)()
        self.loader = loader
        self.model_path = resolve_model_path(args.model)
        hf_config = loader.load_hf_config(self.model_path)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"the model config at {self.model_path} names no `architectures`")
        model_context = getattr(hf_config, "max_position_embeddings", 2048)
        self.model_config = ModelConfig(
            path=self.model_path,
            hf_config=hf_config,
            dtype=self.dtype,
            context_len=args.context_length or model_context,
            architecture=archs[0],
            seed=args.random_seed,
        )
        self.vocab_size = hf_config.vocab_size
        self.model = loader.load_model(self.model_config, DeviceConfig(self.device))
        self.lora_manager = None
        if args.enable_lora:
            from loom.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, args, self.device, self.dtype)
        self._init_memory()
        self._init_attention_backend()
        self.cuda_graph_runner = None
        if (
            self.device.type == "cuda"
            and not args.disable_cuda_graph
            and self.attn_backend.supports_cuda_graph
        ):
            from loom.model_executor.cuda_graph_runner import CudaGraphRunner

            # Eager decode of a large model costs ~10 ms of host time per step (hundreds of
            # launches), which large batches cannot hide: capture up to the running limit.
            max_bs = min(args.cuda_graph_max_bs or _MAX_GRAPH_BS, self.max_running_requests)
            self.cuda_graph_runner = CudaGraphRunner(self, max_bs)

    # ---- memory ---------------------------------------------------------------------------

    def _init_memory(self) -> None:
        args = self.args
        model_cls = type(self.model)
        num_layers, num_kv_heads, head_dim = model_cls.kv_cache_shape(self.model_config.hf_config)
        tp = get_tp_size()
        attn_heads = max(1, num_kv_heads // tp)  # KV heads are replicated when fewer than ranks
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, attn_heads, head_dim
        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else _KV_DTYPES[args.kv_cache_dtype]
        self.kv_dtype = kv_dtype
        per_token = KVPool.bytes_per_token(num_layers, attn_heads, head_dim, kv_dtype)
        if args.max_total_tokens is not None:
            max_tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = args.mem_fraction_static or 0.85
            budget = free - total * (1 - frac)
            max_tokens = int(budget // per_token)
        else:
            frac = args.mem_fraction_static or 0.25
            max_tokens = min(
                int(_available_host_memory() * frac // per_token), _CPU_MAX_AUTO_TOKENS
            )
        num_pages = max_tokens // args.page_size
        if num_pages < 1:
            raise ValueError(
                f"no room for a KV cache: {max_tokens} tokens; raise "
                "--max-total-tokens or --mem-fraction-static"
            )
        self.max_total_tokens = num_pages * args.page_size
        cap = _MAX_AUTO_RUNNING if self.device.type == "cuda" else _CPU_MAX_AUTO_RUNNING
        self.max_running_requests = args.max_running_requests or max(
            1, min(cap, self.max_total_tokens // 2)
        )
        self.kv_pool = KVPool(
            num_pages, args.page_size, num_layers, attn_heads, head_dim, kv_dtype, self.device
        )
        self.allocator = PageAllocator(num_pages, args.page_size)
        # +1 spare row so a request can be set up while max_running are active (retraction).
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, self.model_config.context_len, self.device
        )
        logger.info(
            "KV pool: %d tokens (%d pages of %d), %.1f MB",
            self.max_total_tokens,
            num_pages,
            args.page_size,
            per_token * self.max_total_tokens / 2**20,
        )

    def _init_attention_backend(self) -> None:
        args = self.args
        heads = self.model_config.hf_config.num_attention_heads // get_tp_size()
        ctx = AttentionContext(
            num_heads=heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token_pool,
        )
        built: dict[str, AttentionBackend] = {}  # one instance per name, shared by phases
        prefill = args.prefill_attention_backend or args.attention_backend
        decode = args.decode_attention_backend or args.attention_backend
        p_name = self._pick_attention_backend(prefill, "prefill", ctx, built)
        d_name = self._pick_attention_backend(decode, "decode", ctx, built)
        large, switch = None, ""
        kv_kind = "fp8" if self.kv_dtype in FP8_DTYPES else "model"
        if decode == "auto" and (self.device.type, kv_kind) in _AUTO_DECODE_LARGE:
            l_name, above = _AUTO_DECODE_LARGE[(self.device.type, kv_kind)]
            if l_name != d_name and self._try_attention_backend(l_name, "decode", ctx, built):
                large = (built[l_name], above)
                switch = f" ({l_name} above batch {above})"
        self.prefill_attention_backend_name = p_name
        self.decode_attention_backend_name = d_name + switch
        if p_name == d_name and large is None:
            self.attn_backend, self.attention_backend_name = built[p_name], p_name
        else:
            from loom.layers.attention.hybrid import HybridAttnBackend

            self.attn_backend = HybridAttnBackend(built[p_name], built[d_name], *(large or ()))
            self.attention_backend_name = f"{p_name} prefill + {d_name} decode{switch}"

    def _pick_attention_backend(self, name: str, phase: str, ctx, built: dict) -> str:
        """Build ``name`` (into ``built``) for one phase; ``auto`` takes the first in the
        device's order for that phase that :meth:`_try_attention_backend` can build."""
        if name != "auto":
            if name not in built:
                cls = plugins.resolve("attention_backend", name)
                if not cls.is_supported(self.device):
                    raise ValueError(f"attention backend {name!r} does not support {self.device}")
                built[name] = cls(ctx)
            return name
        order = _AUTO_BACKENDS.get((self.device.type, phase)) or _AUTO_BACKENDS.get(
            self.device.type, ["torch_native"]
        )
        for candidate in order:
            if self._try_attention_backend(candidate, phase, ctx, built):
                return candidate
        raise ValueError(f"no attention backend supports {self.device} / {self.dtype}")

    def _try_attention_backend(self, name: str, phase: str, ctx, built: dict) -> bool:
        """Whether ``name`` can serve here, for ``auto``: registered, supporting the device and
        dtype, and constructed (a backend's constructor raises ValueError for shapes and KV
        dtypes it lacks) into ``built``."""
        if name in built:
            return True
        if name not in set(plugins.names("attention_backend")):
            return False
        cls = plugins.resolve("attention_backend", name)
        if not (cls.is_supported(self.device) and cls.supports_dtype(self.dtype)):
            return False
        try:
            built[name] = cls(ctx)
        except ValueError as e:
            logger.info("attention backend %s skipped for %s: %s", name, phase, e)
            return False
        return True

    # ---- forward --------------------------------------------------------------------------

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _run(self, batch: ForwardBatch, plan: bool = True) -> torch.Tensor:
        self._attach(batch)
        if plan:
            self.attn_backend.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)

    def _attach(self, batch: ForwardBatch) -> ForwardBatch:
        batch.req_to_token_pool = self.req_to_token_pool
        batch.kv_pool = self.kv_pool
        batch.attn_backend = self.attn_backend
        return batch

    @torch.inference_mode()
    def forward_extend(
        self,
        reqs: list[Req],
        input_ids: list[int],
        positions: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        logit_indices: list[int] | None = None,
    ) -> torch.Tensor:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        table = self.req_to_token_pool.req_to_token
        pool_idx = [r.req_pool_idx for r in reqs]
        out_loc = torch.cat(
            [table[i, p:s] for i, p, s in zip(pool_idx, prefix_lens, seq_lens, strict=True)]
        )
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            out_cache_loc=out_loc,
            req_pool_indices=self._tensor(pool_idx),
            seq_lens=self._tensor(seq_lens),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
        )
        if logit_indices is not None:
            batch.logit_indices = self._tensor(logit_indices)
        if self.lora_manager is not None:
            return self._run_lora(batch, [r.lora_slot for r in reqs], extend_lens)
        return self._run(batch)

    def _run_lora(
        self, batch: ForwardBatch, slots: list[int], counts: list[int] | None = None
    ) -> torch.Tensor:
        """A forward with each request's LoRA adapter slot (-1: none) applied to its ``counts``
        tokens (None: one token each)."""
        self.lora_manager.set_batch(slots, counts)
        try:
            return self._run(batch)
        finally:
            self.lora_manager.clear_batch()

    @torch.inference_mode()
    def forward_decode(
        self,
        reqs: list[Req],
        input_ids: list[int] | None,
        positions: list[int],
        out_cache_loc: list[int],
        input_ids_dev: torch.Tensor | None = None,
        id_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """One decode step; also records each request's new slot in the req-to-token table.
        The input ids come from the host (``input_ids``) or are already on the device
        (``input_ids_dev``: the previous step's samples, under overlap scheduling); ``id_rows``:
        each request's row of ``input_ids_dev`` when the batch is not that step's batch (some of
        its requests have finished since), gathered on the device."""
        seq_lens = [p + 1 for p in positions]
        # One host-to-device copy for the whole batch description.
        rows_cpu = [r.req_pool_idx for r in reqs]
        packed = torch.tensor(
            [input_ids or id_rows or [0] * len(reqs), positions, seq_lens, rows_cpu, out_cache_loc],
            dtype=torch.int64,
        ).to(self.device, non_blocking=True)
        ids, pos, lens, rows, locs = packed.unbind(0)
        if input_ids_dev is not None:
            if id_rows is not None:
                input_ids_dev = input_ids_dev.index_select(0, ids)
            ids = input_ids_dev
        self.req_to_token_pool.req_to_token[rows, pos] = locs
        graphs = self.cuda_graph_runner
        # the graphs hold the base model only: batches with an adapter run eagerly
        lora_slots = [r.lora_slot for r in reqs] if self.lora_manager is not None else []
        if graphs is not None and graphs.can_run(len(reqs)) and max(lora_slots, default=-1) < 0:
            return graphs.replay(packed, input_ids_dev, seq_lens)
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=ids,
            positions=pos,
            out_cache_loc=locs,
            req_pool_indices=rows,
            seq_lens=lens,
            seq_lens_cpu=seq_lens,
        )
        if lora_slots:
            return self._run_lora(batch, lora_slots)
        return self._run(batch)
