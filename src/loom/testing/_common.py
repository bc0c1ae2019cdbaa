"""Helpers shared by the conformance kits: instantiating a member, and for the model and
model_loader kits a tiny Llama checkpoint, poisoned construction and a paged forward."""

from __future__ import annotations

import contextlib
import math
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from loom import plugins


def instantiate(family: str, name: str, **kwargs: Any) -> Any:
    target = plugins.resolve(family, name)
    return target(**kwargs) if isinstance(target, type) else target


# ---- models -----------------------------------------------------------------------------------

# Grouped-query attention (4 query heads over 2 KV heads) and a weight scale large enough that a
# wrong layer moves the logits far beyond the fp32 tolerance.
TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{"architectures": ["LlamaForCausalLM"], **TINY_LLAMA, **overrides})


def save_tiny_llama(path: str, config: Any, seed: int = 0) -> nn.Module:
    """HF transformers' model for ``config`` (random, seeded) saved with ``save_pretrained``
    (safetensors) plus a word-level tokenizer ("t3 t17 ..."); returns the HF model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, config.vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
    return hf


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in directory ``path``, by checkpoint name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, file)))
    return out


@contextlib.contextmanager
def poisoned_parameters() -> Iterator[None]:
    """Every floating-point parameter registered on any module inside the block starts as NaN,
    so one that nobody writes afterwards is found by :func:`unwritten_parameters`."""

    def poison(module: nn.Module, name: str, param: Any) -> None:
        if isinstance(param, torch.Tensor) and param.is_floating_point():
            with torch.no_grad():
                param.data.fill_(math.nan)

    handle = nn.modules.module.register_module_parameter_registration_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def unwritten_parameters(model: nn.Module) -> list[str]:
    return [
        n
        for n, p in model.named_parameters()
        if p.is_floating_point() and bool(torch.isnan(p.detach()).any())
    ]


@torch.inference_mode()
def hf_logits(hf: nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence from an HF transformers model, fp32 on CPU."""
    device = next(hf.parameters()).device
    return hf(torch.tensor([ids], device=device)).logits[0].float().cpu()


class PagedForward:
    """What the model runner gives a model: a KV pool shaped by ``kv_cache_shape``, a
    req-to-token table with scattered (shuffled) pages and an attention backend; requests are
    run as extend and decode ``ForwardBatch``es."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str = "torch_native",
        seed: int = 0,
        num_tokens: int = 1024,
        max_context: int = 256,
    ) -> None:
        from loom.layers.attention.base import AttentionContext, attention_features
        from loom.mem_cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool

        self.model, self.device = model, device
        layers, kv_heads, head_dim = type(model).kv_cache_shape(hf_config)
        self.pool = KVPool(num_tokens, 1, layers, kv_heads, head_dim, dtype, device)
        self.table = ReqToTokenPool(8, max_context, device)
        self.alloc = PageAllocator(num_tokens, 1)
        random.Random(seed).shuffle(self.alloc._free)
        ctx = AttentionContext(
            hf_config.num_attention_heads,
            kv_heads,
            head_dim,
            dtype,
            device,
            self.pool,
            self.table,
            attention_features(model),
        )
        self.backend = plugins.resolve("attention_backend", attention_backend)(ctx)

    def new_request(self, max_len: int) -> int:
        """A row of the table with slots for ``max_len`` tokens."""
        row = self.table.alloc()
        assert row is not None, "the kit ran out of table rows"
        slots = self.alloc.alloc(max_len)
        assert slots is not None, "the kit ran out of KV slots"
        self.table.req_to_token[row, :max_len] = torch.tensor(slots, device=self.device)
        return row

    def _run(self, batch: Any) -> torch.Tensor:
        batch.req_to_token_pool, batch.kv_pool, batch.attn_backend = (
            self.table,
            self.pool,
            self.backend,
        )
        self.backend.init_forward_metadata(batch)
        with torch.inference_mode():
            return self.model(batch.input_ids, batch.positions, batch)

    def extend(
        self,
        rows: list[int],
        prefix_lens: list[int],
        chunks: list[list[int]],
        logit_indices: list[int] | None = None,
    ) -> torch.Tensor:
        from loom.forward_batch import ForwardBatch, ForwardMode

        lens = [len(c) for c in chunks]
        seq_lens = [p + n for p, n in zip(prefix_lens, lens, strict=True)]
        t = self.table.req_to_token
        dev = self.device
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=torch.tensor([i for c in chunks for i in c], device=dev),
            positions=torch.cat(
                [torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens, strict=True)]
            ).to(dev),
            out_cache_loc=torch.cat(
                [t[r, p:s] for r, p, s in zip(rows, prefix_lens, seq_lens, strict=True)]
            ),
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=list(prefix_lens),
            extend_seq_lens_cpu=lens,
        )
        if logit_indices is not None:
            batch.logit_indices = torch.tensor(logit_indices, device=dev)
        return self._run(batch)

    def decode(self, rows: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        from loom.forward_batch import ForwardBatch, ForwardMode

        dev = self.device
        seq_lens = [p + 1 for p in positions]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=torch.tensor(tokens, device=dev),
            positions=torch.tensor(positions, device=dev),
            out_cache_loc=self.table.req_to_token[rows, positions],
            req_pool_indices=torch.tensor(rows, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            seq_lens_cpu=seq_lens,
        )
        return self._run(batch)
