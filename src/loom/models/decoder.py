"""The decoder-only transformer that Loom's architectures share, built from Loom's layers.

An architecture file subclasses :class:`DecoderForCausalLM` and states in a :class:`DecoderSpec`
how it departs from Llama (biases, per-head q/k norms, Gemma's norms and scaled embeddings, a
checkpoint with fused projections); what varies per layer or per checkpoint (sliding windows,
rotary bases and scalings, soft-capping, the MLP's activation) is read from the HF config, so one
class serves every checkpoint of its family. A mixture-of-experts architecture replaces the MLP
through :meth:`DecoderForCausalLM.build_mlp`.

Module and parameter names follow HF's (``model.layers.N.self_attn.qkv_proj``, ``mlp.gate_up_
proj``, ...) so that checkpoints load by name and LoRA adapters find their targets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from loom.forward_batch import ForwardBatch
from loom.layers.activation import gated_activation
from loom.layers.attention.layer import Attention
from loom.layers.layernorm import GemmaRMSNorm, RMSNorm
from loom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loom.layers.rotary import context_length, get_rope, rope_params
from loom.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from loom.model_loader.weight_utils import load_packed_weights
from loom.models.base import CausalLM


@dataclass(frozen=True)
class DecoderSpec:
    """How an architecture departs from Llama."""

    # q/k/v projections with a bias, o_proj without (Qwen2); None: both follow the config's
    # ``attention_bias`` (Llama, Qwen3, Gemma)
    qkv_bias: bool | None = None
    # RMSNorm over each head of q and k before the rotary embedding (Qwen3, Gemma 3)
    qk_norm: bool = False
    # Gemma: norms scale by (1 + w), embeddings by sqrt(hidden_size), and the attention and MLP
    # outputs pass a norm of their own before joining the residual stream
    gemma: bool = False
    # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    fused_checkpoint: bool = False
    # the layers' and the final norm, built as ``norm(hidden_size, eps)`` and called as
    # RMSNorm is (``norm(x)`` or ``norm(x, residual) -> (out, x + residual)``); None: RMSNorm
    # (GemmaRMSNorm with ``gemma``)
    norm: Callable[[int, float], nn.Module] | None = None

    def norm_class(self) -> Callable[[int, float], nn.Module]:
        return self.norm or (GemmaRMSNorm if self.gemma else RMSNorm)


def _eps(config: Any) -> float:
    return getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None) or 1e-6


def layer_type(config: Any, layer_id: int) -> str:
    """ "sliding_attention" or "full_attention" for a layer: the config's ``layer_types`` where it
    has them (Qwen2/3, Gemma 2/3), else every layer slides when ``sliding_window`` is set
    (Mistral, Mixtral, Phi-3)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer_id]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _act_name(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, spec: DecoderSpec) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // num_heads
        bias = bool(getattr(config, "attention_bias", False))
        # Qwen2-MoE's configs may name the q/k/v bias ``qkv_bias``
        qkv_bias = bias if spec.qkv_bias is None else getattr(config, "qkv_bias", spec.qkv_bias)
        o_bias = bias if spec.qkv_bias is None else False
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias
        )
        qkv = self.qkv_proj
        self.o_proj = RowParallelLinear(
            num_heads * self.head_dim, self.hidden_size, o_bias, partition=(qkv.q_start, qkv.q_size)
        )
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        if spec.qk_norm:
            norm = GemmaRMSNorm if spec.gemma else RMSNorm
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        kind = layer_type(config, layer_id)
        theta, scaling = rope_params(config, kind)
        rotary = getattr(config, "partial_rotary_factor", None)
        if rotary is None and isinstance(getattr(config, "rope_parameters", None), dict):
            rotary = config.rope_parameters.get("partial_rotary_factor")
        rotary_dim = int(self.head_dim * (rotary or 1.0))
        self.rotary_emb = get_rope(
            self.head_dim,
            rotary_dim,
            config.max_position_embeddings,
            theta,
            scaling,
            num_positions=context_length(config),
        )
        pre_scalar = getattr(config, "query_pre_attn_scalar", None) if spec.gemma else None
        self.attn = Attention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            (pre_scalar or self.head_dim) ** -0.5,
            sliding_window=config.sliding_window if kind == "sliding_attention" else None,
            logit_cap=getattr(config, "attn_logit_softcapping", None) or 0.0,
        )

    def _norm_heads(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view(x.shape)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk_norm = None
        if self.q_norm is not None:
            if self.rotary_emb.fuses(q):  # the rotary kernel normalises each head first
                w_q, w_k = self.q_norm.kernel_weight(), self.k_norm.kernel_weight()
                qk_norm = (w_q, w_k, self.q_norm.eps)
            else:
                q = self._norm_heads(q.contiguous(), self.q_norm)
                k = self._norm_heads(k.contiguous(), self.k_norm)
        pool = batch.kv_pool
        if cos_sin is not None and pool is not None:
            k_cache, v_cache = pool.get_kv(self.attn.layer_id)
            if self.rotary_emb.can_store(q, k_cache):
                # One kernel rotates q and k and stores k and v into the KV pool.
                self.rotary_emb.forward_store(
                    q, k, v, cos_sin, k_cache, v_cache, batch.out_cache_loc, qk_norm
                )
                return self.o_proj(self.attn(q, None, None, batch, save_kv=False))
        q, k = self.rotary_emb(positions, q, k, cos_sin, qk_norm)
        return self.o_proj(self.attn(q, k, v, batch))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP on a residual stream carried as ``(hidden, residual)`` (the
    add deferred into the next norm). Gemma's extra norms on each block's output apply before it
    joins the stream."""

    def __init__(self, config: Any, layer_id: int, spec: DecoderSpec, mlp: nn.Module) -> None:
        super().__init__()
        norm = spec.norm_class()
        size, eps = config.hidden_size, _eps(config)
        self.self_attn = DecoderAttention(config, layer_id, spec)
        self.mlp = mlp
        self.input_layernorm = norm(size, eps)
        self.post_attention_layernorm = norm(size, eps)
        if spec.gemma:
            self.pre_feedforward_layernorm = norm(size, eps)
            self.post_feedforward_layernorm = norm(size, eps)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, positions, hidden, residual, batch, cos_sin=None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch, cos_sin)
        if self.pre_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, build_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, spec, build_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = spec.norm_class()(config.hidden_size, _eps(config))
        self.embed_scale = config.hidden_size**0.5 if spec.gemma else None
        # Layers of one rotary table share its cos/sin, gathered once per forward per table.
        self._rope_groups: list[tuple[nn.Module, list[int]]] = []
        for i, layer in enumerate(self.layers):
            rope = layer.self_attn.rotary_emb
            group = next((g for r, g in self._rope_groups if r is rope), None)
            if group is None:
                self._rope_groups.append((rope, [i]))
            else:
                group.append(i)

    def forward(self, input_ids, positions, batch):
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            # HF multiplies by the scale rounded to the activations' dtype
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        cos_sin: list[Any] = [None] * len(self.layers)
        for rope, ids in self._rope_groups:
            table = rope.cos_sin(positions, hidden.dtype)
            for i in ids:
                cos_sin[i] = table
        for layer, cs in zip(self.layers, cos_sin, strict=True):
            hidden, residual = layer(positions, hidden, residual, batch, cs)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """A decoder-only causal LM; subclasses set :attr:`spec` and may override
    :meth:`build_mlp` and :meth:`checkpoint_weights`."""

    spec: ClassVar[DecoderSpec] = DecoderSpec()
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.spec, self.build_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.final_logit_cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def build_mlp(self, config: Any, layer_id: int) -> nn.Module:
        """The feed-forward block of layer ``layer_id`` (a mixture of experts overrides it)."""
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            _act_name(config),
            bool(getattr(config, "mlp_bias", False)),
        )

    def forward(self, input_ids, positions, batch):
        return self.compute_logits(self.forward_hidden(input_ids, positions, batch), batch)

    def forward_hidden(self, input_ids, positions, batch):
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden, batch):
        last = hidden[batch.last_token_indices()] if not batch.is_decode else hidden
        logits = self.lm_head.compute_logits(last).float()
        if self.final_logit_cap:
            cap = self.final_logit_cap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs as :meth:`load_weights` routes them by name; a
        subclass may load some itself (adding the parameters' names to ``loaded``). With
        ``spec.fused_checkpoint``, fused qkv_proj / gate_up_proj tensors are split into the
        q/k/v and gate/up parts (so each is sliced for tensor parallelism on its own)."""
        if not self.spec.fused_checkpoint:
            yield from weights
            return
        head_dim = self.model.layers[0].self_attn.head_dim
        heads = self.config.num_attention_heads
        q = heads * head_dim
        kv = (getattr(self.config, "num_key_value_heads", None) or heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                for part, t in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                    yield name.replace(".qkv_proj.", f".{part}_proj."), t
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ["rotary_emb.inv_freq"]
        if self.tie_word_embeddings:
            skip.append("lm_head.weight")
        loaded: set[str] = set()
        loaded |= load_packed_weights(
            self, self.checkpoint_weights(weights, loaded), self.packed_modules_mapping, skip
        )
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded
