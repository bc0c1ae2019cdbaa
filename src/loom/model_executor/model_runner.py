"""ModelRunner: owns the device, the model, the KV memory and the attention backend, and turns
batches described by arrays (token ids, positions, request rows, slots) into logits.

It sizes the KV pool and reports the capacity (``num_pages``, ``max_running_requests``); the
cache manager creates the page allocator and the request-to-token table for it and hands the
table back (``bind``), after which the attention backends and CUDA graphs are built."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from loom.config import device_defaults
from loom.distributed import agree_on_error, get_tp_rank, get_tp_size, head_shard
from loom.forward_batch import ForwardBatch, ForwardMode, int64_tensor
from loom.layers.attention.base import AttentionContext, attention_features
from loom.mem_cache.memory_pool import KVPool, ReqToTokenPool
from loom.model_executor.graph_setup import GraphSetup
from loom.model_executor.weights import log_load, model_config_for, swap_weights
from loom.model_loader.base import DeviceConfig

if TYPE_CHECKING:
    from loom.config import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


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


class ModelRunner(GraphSetup):
    def __init__(self, server_args: ServerArgs, loader=None) -> None:
        args = server_args
        self.args = args
        self.device = resolve_device(args.device)
        self.defaults = device_defaults(self.device.type)
        self.dtype = resolve_dtype(args.dtype, self.device)
        torch.manual_seed(args.random_seed)
        self.loader, self.model_config = model_config_for(args, self.dtype, loader)
        self.model_path = self.model_config.path
        loader = self.loader
        self.vocab_size = self.model_config.hf_config.vocab_size
        start = time.perf_counter()
        self.model = loader.load_model(self.model_config, DeviceConfig(self.device))
        log_load(self.model, self.device, time.perf_counter() - start)
        self.lora_manager = None
        if args.enable_lora:
            from loom.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, args.lora_args, self.device, self.dtype)
        self._init_memory()
        self.req_to_token_pool = None
        self.attn_backend = None
        self.tp_leader = None  # rank 0 of several: sends each model call to the other ranks
        self.cuda_graph_runner = None
        self.piecewise_graph_runner = None
        self.mixed_graph_runner = None
        self.compiled_decode = None

    def check_ranks(self) -> None:
        """Raise naming any tensor-parallel rank of this host that has exited."""
        if self.tp_leader is not None:
            self.tp_leader.check()

    def close(self) -> None:
        if self.tp_leader is not None:
            self.tp_leader.close()

    @property
    def ranks_failed(self) -> bool:
        """Whether a call to the other tensor-parallel ranks failed (the server must stop)."""
        return self.tp_leader is not None and self.tp_leader.failed

    def explain_failure(self, error: RuntimeError) -> RuntimeError:
        """``error`` as the scheduler reports it: with tensor parallelism, naming the ranks."""
        return error if self.tp_leader is None else self.tp_leader.explain(error)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> None:
        """Swap in the checkpoint at ``model_path`` (``weights.swap_weights``); raises
        ValueError with the current weights untouched when it cannot."""
        if self.tp_leader is not None:
            self.tp_leader.send(
                "update_weights_from_disk", {"model_path": model_path, "load_format": load_format}
            )
        args = self.args.replace(model=model_path, load_format=load_format or self.args.load_format)
        agree = agree_on_error if get_tp_size() > 1 else None  # every rank copies, or none
        self.loader, self.model_config = swap_weights(
            self.model, self.model_config, args, self.dtype, self.device, agree
        )
        self.model_path = self.model_config.path

    def bind(self, req_to_token_pool: ReqToTokenPool) -> None:
        """Take the request-to-token table (the cache manager's; the attention kernels read
        it) and build what reads it: the attention backends and, on CUDA, the decode graphs.
        The runner forwards only once bound."""
        self.req_to_token_pool = req_to_token_pool
        self._init_attention_backend()
        self.capture_graphs()
        self.compile_decode()

    # ---- memory ---------------------------------------------------------------------------

    def _init_memory(self) -> None:
        args = self.args
        model_cls = type(self.model)
        num_layers, num_kv_heads, head_dim = model_cls.kv_cache_shape(self.model_config.hf_config)
        tp = get_tp_size()
        heads = self.model_config.hf_config.num_attention_heads
        self.heads = head_shard(heads, num_kv_heads, get_tp_rank(), tp)
        attn_heads = self.heads.num_kv_heads
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, attn_heads, head_dim
        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else _KV_DTYPES[args.kv_cache_dtype]
        self.kv_dtype = kv_dtype
        per_token = KVPool.bytes_per_token(num_layers, attn_heads, head_dim, kv_dtype)
        frac = args.mem_fraction_static or self.defaults.mem_fraction_static
        if args.max_total_tokens is not None:
            max_tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            max_tokens = int((free - total * (1 - frac)) // per_token)
        else:
            max_tokens = int(_available_host_memory() * frac // per_token)
        if args.max_total_tokens is None and self.defaults.max_total_tokens is not None:
            max_tokens = min(max_tokens, self.defaults.max_total_tokens)
        if tp > 1:  # every rank's pool and table the same shape: rank 0 hands out their slots
            agreed = torch.tensor([max_tokens], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            max_tokens = int(agreed.item())
        num_pages = max_tokens // args.page_size
        if num_pages < 1:
            raise ValueError(
                f"no room for a KV cache: {max_tokens} tokens; raise "
                "--max-total-tokens or --mem-fraction-static"
            )
        self.num_pages = num_pages
        self.max_total_tokens = num_pages * args.page_size
        self.max_running_requests = args.max_running_requests or max(
            1, min(self.defaults.max_running_requests, self.max_total_tokens // 2)
        )
        self.kv_pool = KVPool(
            num_pages, args.page_size, num_layers, attn_heads, head_dim, kv_dtype, self.device
        )
        logger.info(
            "KV pool: %d tokens (%d pages of %d), %.1f MB",
            self.max_total_tokens,
            num_pages,
            args.page_size,
            per_token * self.max_total_tokens / 2**20,
        )

    def _init_attention_backend(self) -> None:
        from loom.model_executor.attention_choice import build_attention_backends

        args = self.args
        ctx = AttentionContext(
            num_heads=self.heads.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token_pool,
            features=attention_features(self.model),
        )
        (
            self.attn_backend,
            self.attention_backend_name,
            self.prefill_attention_backend_name,
            self.decode_attention_backend_name,
        ) = build_attention_backends(
            ctx,
            args.prefill_attention_backend or args.attention_backend,
            args.decode_attention_backend or args.attention_backend,
            mixed_first=self._wants_mixed_graphs(),
        )

    # ---- forward --------------------------------------------------------------------------

    def _tensor(self, values) -> torch.Tensor:
        return int64_tensor(values).to(self.device, non_blocking=True)

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
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        lora_slots: list[int] | None = None,
        logit_indices: list[int] | None = None,
        ids_from: tuple[torch.Tensor, list[int]] | None = None,
        table_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One prefill (extend) forward over requests' new tokens, concatenated: request ``i``
        (row ``req_pool_indices[i]`` of the req-to-token table, whose slots for these positions
        are written) computes ``extend_lens[i]`` tokens after its ``prefix_lens[i]`` cached
        ones. ``lora_slots``: each request's adapter slot (-1: none). The logits of each
        request's last token, or of ``logit_indices``. ``ids_from``: the ids of the batch's last
        tokens are still on the device, ``(tokens, rows)``: token ``-len(rows) + j`` is
        ``tokens[rows[j]]`` (a mixed step's decoding rows, on the samples of the decode step in
        flight; their entries in ``input_ids`` are ignored). ``table_rows``: on a worker rank,
        rank 0's entries of the requests' table rows up to their new length, concatenated."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        pool_idx = list(req_pool_indices)
        if self.tp_leader is not None:
            self.tp_leader.send(
                "forward_extend",
                {
                    "input_ids": input_ids,
                    "positions": positions,
                    "req_pool_indices": pool_idx,
                    "prefix_lens": prefix_lens,
                    "extend_lens": extend_lens,
                    "lora_slots": lora_slots,
                    "logit_indices": logit_indices,
                    "ids_from": ids_from,
                    "table_rows": self.req_to_token_pool.take_rows(pool_idx, seq_lens),
                },
            )
        elif table_rows is not None:
            self.req_to_token_pool.put_rows(pool_idx, seq_lens, table_rows)
        table = self.req_to_token_pool.req_to_token
        bs, n = len(pool_idx), len(input_ids)
        # One host-to-device copy: each token's id, position and request row, then the request
        # rows and sequence lengths; the tokens' KV slots are gathered from the table.
        token_rows = [r for r, e in zip(pool_idx, extend_lens, strict=True) for _ in range(e)]
        src_rows = ids_from[1] if ids_from is not None else []
        packed = int64_tensor(
            [*input_ids, *positions, *token_rows, *pool_idx, *seq_lens, *src_rows]
        ).to(self.device, non_blocking=True)
        ids, pos, rows = packed[: 3 * n].view(3, n).unbind(0)
        if src_rows:
            m = len(src_rows)
            ids[n - m :] = ids_from[0].index_select(0, packed[3 * n + 2 * bs :])
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=bs,
            input_ids=ids,
            positions=pos,
            out_cache_loc=table[rows, pos],
            req_pool_indices=packed[3 * n : 3 * n + bs],
            seq_lens=packed[3 * n + bs : 3 * n + 2 * bs],
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=list(extend_lens),
        )
        with_lora = self.lora_manager is not None and max(lora_slots or [-1]) >= 0
        mixed = self.mixed_graph_runner
        fit = mixed.fits(extend_lens) if mixed is not None and not with_lora else None
        if fit is not None:
            hidden, batch.logit_indices = mixed.run(
                torch.stack([ids, pos, batch.out_cache_loc]),
                pool_idx,
                prefix_lens,
                extend_lens,
                fit,
                logit_indices,
            )
            logits = self.model.compute_logits(hidden, batch)
            return logits if logit_indices is not None else logits[:bs]
        if logit_indices is not None:
            batch.logit_indices = self._tensor(logit_indices)
        graphs = self.piecewise_graph_runner
        if graphs is not None and graphs.can_run(n) and not with_lora:
            # (the graphs hold the base model only: batches with an adapter run eagerly)
            hidden = graphs.run(torch.stack([ids, pos, batch.out_cache_loc]), self._attach(batch))
            return self.model.compute_logits(hidden, batch)
        if self.lora_manager is not None:
            slots = lora_slots if lora_slots is not None else [-1] * bs
            return self._run_lora(batch, slots, extend_lens)
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
        input_ids: list[int] | None,
        positions: list[int],
        out_cache_loc: list[int],
        req_pool_indices: list[int],
        lora_slots: list[int] | None = None,
        input_ids_dev: torch.Tensor | None = None,
        id_rows: list[int] | None = None,
        table_fix: tuple[list[int], list[int], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One decode step (request ``i``: row ``req_pool_indices[i]``, its token at
        ``positions[i]`` into slot ``out_cache_loc[i]``, adapter slot ``lora_slots[i]``); also
        records each request's new slot in the req-to-token table.
        The input ids come from the host (``input_ids``) or are already on the device
        (``input_ids_dev``: the previous step's samples, under overlap scheduling); ``id_rows``:
        each request's row of ``input_ids_dev`` when the batch is not that step's batch (some of
        its requests have finished since), gathered on the device."""
        if self.tp_leader is not None:
            # rows the cache manager rewrote since their extend (a prefix it deduplicated)
            dirty = self.req_to_token_pool.dirty
            stale = [(r, p) for r, p in zip(req_pool_indices, positions, strict=True) if r in dirty]
            fix = None
            if stale:
                rows, lens = [r for r, _ in stale], [p for _, p in stale]
                fix = (rows, lens, self.req_to_token_pool.take_rows(rows, lens))
            self.tp_leader.send(
                "forward_decode",
                {
                    "input_ids": input_ids,
                    "positions": positions,
                    "out_cache_loc": out_cache_loc,
                    "req_pool_indices": req_pool_indices,
                    "lora_slots": lora_slots,
                    "input_ids_dev": input_ids_dev,
                    "id_rows": id_rows,
                    "table_fix": fix,
                },
            )
        elif table_fix is not None:
            self.req_to_token_pool.put_rows(*table_fix)
        seq_lens = [p + 1 for p in positions]
        # One host-to-device copy for the whole batch description.
        rows_cpu = list(req_pool_indices)
        bs = len(rows_cpu)
        packed = (
            int64_tensor(
                [
                    *(input_ids or id_rows or [0] * bs),
                    *positions,
                    *seq_lens,
                    *rows_cpu,
                    *out_cache_loc,
                ]
            )
            .view(5, bs)
            .to(self.device, non_blocking=True)
        )
        ids, pos, lens, rows, locs = packed.unbind(0)
        if input_ids_dev is not None:
            if id_rows is not None:
                input_ids_dev = input_ids_dev.index_select(0, ids)
            ids = input_ids_dev
        self.req_to_token_pool.req_to_token[rows, pos] = locs
        graphs = self.cuda_graph_runner
        if self.lora_manager is None or lora_slots is None:
            lora_slots = []
        with_lora = max(lora_slots, default=-1) >= 0
        # graphs captured without the adapters' kernels leave batches with an adapter eager
        if graphs is not None and graphs.can_run(bs) and (not with_lora or graphs.lora):
            return graphs.replay(packed, input_ids_dev, seq_lens, lora_slots or None)
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=ids,
            positions=pos,
            out_cache_loc=locs,
            req_pool_indices=rows,
            seq_lens=lens,
            seq_lens_cpu=seq_lens,
        )
        if lora_slots:
            return self._run_lora(batch, lora_slots)
        if self.compiled_decode is not None and self.compiled_decode.can_run(bs):
            return self.compiled_decode.run(batch)
        return self._run(batch)
