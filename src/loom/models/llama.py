"""Llama (and Llama-shaped models: SmolLM2, Llama-3, TinyLlama, ...)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.distributed import get_tp_size
from loom.forward_batch import ForwardBatch
from loom.layers.activation import SiluAndMul
from loom.layers.attention.layer import Attention
from loom.layers.layernorm import RMSNorm
from loom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loom.layers.rotary import get_rope, rope_params
from loom.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from loom.model_loader.weight_utils import load_packed_weights
from loom.models.base import CausalLM


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        tp = get_tp_size()
        self.hidden_size = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // num_heads
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size, self.head_dim, num_heads, num_kv_heads, bias
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, self.hidden_size, bias)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        theta, scaling = rope_params(config)
        rotary_dim = int(self.head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary_emb = get_rope(
            self.head_dim, rotary_dim, config.max_position_embeddings, theta, scaling
        )
        self.attn = Attention(
            layer_id,
            num_heads // tp,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        pool = batch.kv_pool
        if cos_sin is not None and pool is not None:
            k_cache, v_cache = pool.get_kv(self.attn.layer_id)
            if self.rotary_emb.can_store(q, k_cache):
                # One kernel rotates q and k and stores k and v into the KV pool.
                self.rotary_emb.forward_store(
                    q, k, v, cos_sin, k_cache, v_cache, batch.out_cache_loc
                )
                return self.o_proj(self.attn(q, None, None, batch, save_kv=False))
        q, k = self.rotary_emb(positions, q, k, cos_sin)
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, batch, cos_sin=None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, batch):
        hidden, residual = self.embed_tokens(input_ids), None
        # Layers share one rotary table (get_rope): gather cos/sin once per forward.
        cos_sin = self.layers[0].self_attn.rotary_emb.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch, cos_sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids, positions, batch):
        return self.compute_logits(self.forward_hidden(input_ids, positions, batch), batch)

    def forward_hidden(self, input_ids, positions, batch):
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden, batch):
        last = hidden[batch.last_token_indices()] if not batch.is_decode else hidden
        return self.lm_head.compute_logits(last).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ["rotary_emb.inv_freq"]
        if self.tie_word_embeddings:
            skip.append("lm_head.weight")
        loaded = load_packed_weights(self, weights, self.packed_modules_mapping, skip)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded
