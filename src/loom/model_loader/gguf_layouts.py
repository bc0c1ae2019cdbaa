"""What llama.cpp's converter (``convert_hf_to_gguf.py``) writes for each architecture Loom
serves, and the way back: the HF config from a file's metadata, and every tensor's HF checkpoint
name and values.

One :class:`Layout` per GGUF architecture (``general.architecture``). The GGUF side of each name
comes from gguf-py's own table (``gguf.TensorNameMap``, the one the converter names tensors
with); a layout lists its family's HF checkpoint names and what the converter did to values:

- ``llama`` (Llama; Mistral, which llama.cpp writes as llama; Mixtral, llama with experts): q and
  k rows permuted into llama.cpp's rotary order (no other family is permuted); Llama 3's rope
  scaling written as per-frequency divisors (``rope_freqs``), read back into HF's parameters.
- ``gemma2``, ``gemma3``: every RMSNorm weight (q/k norms included) stored as ``w + 1``; HF's
  and Loom's Gemma norms scale by ``1 + w``, so 1 is subtracted.
- ``qwen2moe``, ``qwen3moe`` and Mixtral: each layer's experts stacked into one ``[E, out, in]``
  tensor per projection (``ffn_{gate,up,down}_exps``), split back into HF's per-expert names;
  Qwen2-MoE's shared expert and its sigmoid gate (``*_shexp``) keep HF's shapes.
- ``phi3``: q/k/v and gate/up stay fused as in HF's checkpoint (``attn_qkv``; ``ffn_up`` holds
  gate then up).

What a file cannot state is llama.cpp's fixed rule for the family, applied here the same way:
Gemma's sliding-window layer pattern and query scale, Qwen-MoE's top-k renormalisation (Qwen2:
no, Qwen3: yes) with every layer sparse, no sliding window for llama and qwen2.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import Keys

logger = logging.getLogger(__name__)

# HF checkpoint names (without .weight / .bias) under model.layers.N
_NORMS = ("input_layernorm", "post_attention_layernorm")
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_ROUTER = ("mlp.gate",)
_SHARED_EXPERT = (
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
    "mlp.shared_expert_gate",
)
# mlp.experts.{e}.<projection>: one stacked [E, ...] tensor per projection in a file
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class Metadata:
    """A file's metadata and tensors, read through gguf-py's key templates
    (``meta(Keys.LLM.BLOCK_COUNT)`` reads ``{arch}.block_count``)."""

    def __init__(self, fields: dict[str, Any], tensors: dict[str, Any]) -> None:
        self.fields = fields
        self.tensors = tensors  # name -> gguf ReaderTensor
        self.arch = fields.get(Keys.General.ARCHITECTURE)

    def __call__(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key.format(arch=self.arch))
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key.format(arch=self.arch)!r}")
        return value

    def tensor(self, name: str) -> np.ndarray | None:
        """A (small) tensor's values as float32, or None when the file has none of that name."""
        t = self.tensors.get(name)
        if t is None:
            return None
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF rotate_half halves)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclass(frozen=True)
class Layout:
    """One GGUF architecture as llama.cpp's converter writes it."""

    arch: gguf.MODEL_ARCH  # gguf-py's architecture: its tensor-name table
    model_type: str  # the HF config's model_type
    architecture: str  # the HF architectures name (a Loom model)
    layer_names: tuple[str, ...]  # HF checkpoint names under model.layers.N
    # the family's own config fields, from the metadata and the fields every family shares
    config: Callable[[Metadata, dict[str, Any]], dict[str, Any]]
    experts: bool = False  # stacked experts (``ffn_*_exps``)
    permuted_qk: bool = False  # q/k rows in llama.cpp's rotary order
    norm_offset: float = 0.0  # added to every norm weight by the converter
    # the layout of a file that has experts (llama.cpp writes Mixtral as llama)
    with_experts: Layout | None = None

    @functools.cached_property
    def _names(self) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """(GGUF global name -> HF, GGUF layer leaf -> HF layer name, GGUF leaf -> expert
        projection), from gguf-py's table at block 0."""
        table = gguf.TensorNameMap(self.arch, 1)
        globals_ = {g: hf for hf in _GLOBAL if (g := table.get_name(hf)) is not None}
        leaves, experts = {}, {}
        for hf in self.layer_names:
            g = table.get_name(f"model.layers.0.{hf}")
            if g is not None:
                leaves[g.removeprefix("blk.0.")] = hf
        if self.experts:
            for proj in _EXPERT_PROJS:
                g = table.get_name(f"model.layers.0.mlp.experts.{proj}")
                experts[g.removeprefix("blk.0.")] = proj
        return globals_, leaves, experts

    def hf_name(self, name: str) -> str | None:
        """The HF checkpoint name of GGUF tensor ``name``; None for one that is not a weight of
        the model (rope tables, which the config states). Stacked experts give a template with
        ``{e}`` for the expert."""
        globals_, leaves, experts = self._names
        m = _BLOCK.match(name)
        if m is None:
            base, _, kind = name.rpartition(".")
            hf = globals_.get(base)
            return f"{hf}.{kind}" if hf else None
        layer, leaf, kind = m.groups()
        if leaf in experts:
            return f"model.layers.{layer}.mlp.experts.{{e}}.{experts[leaf]}.{kind}"
        hf = leaves.get(leaf)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None

    def hf_tensors(self, name: str, w: np.ndarray, config: Any) -> Iterator[tuple[str, np.ndarray]]:
        """The (HF name, values) pairs of GGUF tensor ``name`` holding ``w`` (dequantised)."""
        hf = self.hf_name(name)
        if hf is None:
            if not name.startswith("rope_"):
                logger.warning("GGUF tensor %s has no HF name in the %s layout", name, self.arch)
            return
        if "{e}" in hf:
            for e in range(w.shape[0]):
                yield hf.format(e=e), w[e]
            return
        if self.permuted_qk and ".q_proj." in hf:
            w = unpermute_rotary(w, config.num_attention_heads)
        elif self.permuted_qk and ".k_proj." in hf:
            w = unpermute_rotary(w, config.num_key_value_heads)
        elif self.norm_offset and hf.endswith("norm.weight"):
            w = w - np.float32(self.norm_offset)
        elif hf.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # older converters squeezed it to [hidden]
        yield hf, w

    def hf_config(self, meta: Metadata) -> Any:
        from transformers import AutoConfig

        base = _base_config(meta)
        kwargs = {**base, **self.config(meta, base), "architectures": [self.architecture]}
        return AutoConfig.for_model(self.model_type, **kwargs)


def _rope(meta: Metadata, theta: float) -> dict[str, Any]:
    """HF rope parameters from the file's rope keys (linear and YaRN scaling)."""
    R = Keys.Rope
    kind, factor = meta(R.SCALING_TYPE), meta(R.SCALING_FACTOR)
    if kind == "linear" and factor:
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn" and factor:
        rope = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(factor),
            "original_max_position_embeddings": int(meta.require(R.SCALING_ORIG_CTX_LEN)),
        }
        for key, hf in (
            (R.SCALING_YARN_ATTN_FACTOR, "attention_factor"),
            (R.SCALING_YARN_BETA_FAST, "beta_fast"),
            (R.SCALING_YARN_BETA_SLOW, "beta_slow"),
        ):
            if meta(key) is not None:
                rope[hf] = float(meta(key))
        return rope
    return {"rope_type": "default", "rope_theta": theta}


def _base_config(meta: Metadata) -> dict[str, Any]:
    """What every family's file states the same way."""
    T = Keys.Tokenizer
    heads = int(meta.require(Keys.Attention.HEAD_COUNT))
    hidden = int(meta.require(Keys.LLM.EMBEDDING_LENGTH))
    head_dim = int(meta(Keys.Attention.KEY_LENGTH, hidden // heads))
    rope = _rope(meta, float(meta(Keys.Rope.FREQ_BASE, 10000.0)))
    # llama.cpp ends generation at any end-of-generation token: EOS, end-of-turn, end-of-message
    eos = dict.fromkeys(
        int(i) for k in (T.EOS_ID, T.EOT_ID, T.EOM_ID) if (i := meta(k)) is not None
    )
    out = dict(
        # the embedding's rows: Gemma 3's converter drops the ones past the tokenizer's
        vocab_size=int(meta.tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        num_hidden_layers=int(meta.require(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=heads,
        num_key_value_heads=int(meta(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta(Keys.LLM.CONTEXT_LENGTH, 2048)),
        rms_norm_eps=float(meta(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        rope_parameters=rope,
        # the converter writes the output projection only when it is not the embedding
        tie_word_embeddings="output.weight" not in meta.tensors,
        bos_token_id=meta(T.BOS_ID),
        eos_token_id=(list(eos) if len(eos) > 1 else next(iter(eos), None)),
        pad_token_id=meta(T.PAD_ID),
    )
    rotary_dim = int(meta(Keys.Rope.DIMENSION_COUNT, head_dim))
    if rotary_dim != head_dim:
        out["partial_rotary_factor"] = rotary_dim / head_dim
    if meta(Keys.LLM.FEED_FORWARD_LENGTH) is not None:
        out["intermediate_size"] = int(meta(Keys.LLM.FEED_FORWARD_LENGTH))
    return out


def _nothing_more(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {}


def _llama(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # Llama 3's rope scaling reaches the file only as one divisor per frequency (rope_freqs)
    divisors = meta.tensor("rope_freqs.weight")
    if divisors is None or float(divisors.max()) <= 1.0:
        return {}
    theta = base["rope_parameters"]["rope_theta"]
    return {"rope_parameters": _llama3_rope(divisors, theta, base["head_dim"])}


def _llama3_rope(divisors: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """HF's llama3 rope parameters that give these per-frequency divisors. Between the
    unscaled and the fully scaled (``factor``) frequencies, 1/divisor = (1 - s)/factor + s with
    s = (orig / wavelength - low) / (high - low): linear in 1/wavelength, so two such
    frequencies fix it; with ``low_freq_factor`` 1 (Llama 3's), that gives ``orig`` and
    ``high`` (rounded: the divisors are float32). Without two, Llama 3's values are taken."""
    factor = float(divisors.max())
    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    between = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    original, high = 8192, 4.0
    if between.sum() >= 2:
        # slope = orig / (high - 1), intercept = -1 / (high - 1)
        slope, intercept = np.polyfit(1 / wavelength[between], s[between], 1)
        original = round(float(slope / -intercept))
        high = round(1 + original / float(slope), 3)
    smooth = np.clip((original / wavelength - 1) / (high - 1), 0.0, 1.0)
    if np.abs((1 - smooth) / factor + smooth - 1 / divisors).max() > 1e-3:
        logger.warning("rope_freqs are not Llama 3's rope scaling; rotary positions will differ")
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _qwen2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's qwen2 attends in full: a sliding window never reaches the file
    return {"use_sliding_window": False}


def _mixtral(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": None,  # llama.cpp's llama attends in full
        "num_local_experts": int(meta.require(Keys.LLM.EXPERT_COUNT)),
        "num_experts_per_tok": int(meta.require(Keys.LLM.EXPERT_USED_COUNT)),
    }


def _qwen_moe(
    norm_topk_prob: bool, shared: bool
) -> Callable[[Metadata, dict[str, Any]], dict[str, Any]]:
    def config(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
        out = {
            "num_experts": int(meta.require(Keys.LLM.EXPERT_COUNT)),
            "num_experts_per_tok": int(meta.require(Keys.LLM.EXPERT_USED_COUNT)),
            "moe_intermediate_size": int(meta.require(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            # llama.cpp's qwen2moe / qwen3moe: every layer sparse, fixed renormalisation
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": norm_topk_prob,
        }
        if shared:
            out["shared_expert_intermediate_size"] = int(
                meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
            )
        return out

    return config


def _layer_types(meta: Metadata, period: int) -> list[str]:
    """llama.cpp's sliding-window layers: the file's pattern (a period or one flag per layer),
    else the family's period ``n`` (layer i slides unless i % n == n - 1)."""
    layers = int(meta.require(Keys.LLM.BLOCK_COUNT))
    pattern = meta(Keys.Attention.SLIDING_WINDOW_PATTERN, period)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _query_pre_attn_scalar(meta: Metadata, layers_27b: int) -> int:
    """llama.cpp scales queries by 1/sqrt(head_dim), except in the 27B models (told apart by
    their layer count), which scale by 1/sqrt(hidden / heads): HF's query_pre_attn_scalar."""
    hidden = int(meta.require(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(meta.require(Keys.Attention.HEAD_COUNT))
    if int(meta.require(Keys.LLM.BLOCK_COUNT)) == layers_27b:
        return hidden // heads
    return int(meta(Keys.Attention.KEY_LENGTH, hidden // heads))


def _gemma2(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": int(meta.require(Keys.Attention.SLIDING_WINDOW)),
        "layer_types": _layer_types(meta, 2),
        "query_pre_attn_scalar": _query_pre_attn_scalar(meta, 46),
        # llama.cpp's defaults when the keys are absent
        "attn_logit_softcapping": float(meta(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0)),
        "final_logit_softcapping": float(meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0)),
    }


def _gemma3(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp: global layers rotate as the rope keys say, local ones at their own base
    # (default 10,000), unscaled
    local = {"rope_type": "default", "rope_theta": float(meta(Keys.Rope.FREQ_BASE_SWA, 10000.0))}
    window = meta(Keys.Attention.SLIDING_WINDOW)
    cap = meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING)
    return {
        "sliding_window": int(window) if window else None,
        "layer_types": _layer_types(meta, 6 if window else 1),
        "rope_parameters": {"full_attention": base["rope_parameters"], "sliding_attention": local},
        "query_pre_attn_scalar": _query_pre_attn_scalar(meta, 62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": float(cap) if cap else None,
    }


def _phi3(meta: Metadata, base: dict[str, Any]) -> dict[str, Any]:
    window = int(meta(Keys.Attention.SLIDING_WINDOW, 0))  # 0: none (Phi-4)
    context = int(meta(Keys.LLM.CONTEXT_LENGTH, 4096))
    original = int(meta(Keys.Rope.SCALING_ORIG_CTX_LEN, context))
    out: dict[str, Any] = {
        "sliding_window": window or None,
        "original_max_position_embeddings": original,
    }
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        out["rope_parameters"] = {
            **base["rope_parameters"],
            "rope_type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": short.tolist(),
            "original_max_position_embeddings": original,
        }
    return out


_LLAMA_NAMES = _NORMS + _ATTN + _MLP
_QWEN3_NAMES = _LLAMA_NAMES + _QK_NORMS
_GEMMA_NAMES = _LLAMA_NAMES + _GEMMA_NORMS

# GGUF architecture -> layout. A file of another architecture raises an error listing these.
LAYOUTS: dict[str, Layout] = {
    "llama": Layout(
        gguf.MODEL_ARCH.LLAMA,
        "llama",
        "LlamaForCausalLM",
        _LLAMA_NAMES,
        _llama,
        permuted_qk=True,
        with_experts=Layout(
            gguf.MODEL_ARCH.LLAMA,
            "mixtral",
            "MixtralForCausalLM",
            _NORMS + _ATTN + _ROUTER,
            _mixtral,
            experts=True,
            permuted_qk=True,
        ),
    ),
    "qwen2": Layout(gguf.MODEL_ARCH.QWEN2, "qwen2", "Qwen2ForCausalLM", _LLAMA_NAMES, _qwen2),
    "qwen3": Layout(
        gguf.MODEL_ARCH.QWEN3, "qwen3", "Qwen3ForCausalLM", _QWEN3_NAMES, _nothing_more
    ),
    "qwen2moe": Layout(
        gguf.MODEL_ARCH.QWEN2MOE,
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _NORMS + _ATTN + _ROUTER + _SHARED_EXPERT,
        _qwen_moe(norm_topk_prob=False, shared=True),
        experts=True,
    ),
    "qwen3moe": Layout(
        gguf.MODEL_ARCH.QWEN3MOE,
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _NORMS + _ATTN + _QK_NORMS + _ROUTER,
        _qwen_moe(norm_topk_prob=True, shared=False),
        experts=True,
    ),
    "gemma2": Layout(
        gguf.MODEL_ARCH.GEMMA2,
        "gemma2",
        "Gemma2ForCausalLM",
        _GEMMA_NAMES,
        _gemma2,
        norm_offset=1.0,
    ),
    "gemma3": Layout(
        gguf.MODEL_ARCH.GEMMA3,
        "gemma3_text",
        "Gemma3ForCausalLM",
        _GEMMA_NAMES + _QK_NORMS,
        _gemma3,
        norm_offset=1.0,
    ),
    "phi3": Layout(
        gguf.MODEL_ARCH.PHI3,
        "phi3",
        "Phi3ForCausalLM",
        # HF's fused names (attn_qkv, ffn_up = gate|up); separate q/k/v where a file has them
        _NORMS + _ATTN + ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"),
        _phi3,
    ),
}


def layout_for(meta: Metadata) -> Layout:
    """The layout of a file with this metadata."""
    layout = LAYOUTS.get(meta.arch)
    if layout is None:
        raise ValueError(
            f"GGUF architecture {meta.arch!r} is not supported; supported: {', '.join(LAYOUTS)}"
        )
    if layout.with_experts is not None and meta(Keys.LLM.EXPERT_COUNT):
        layout = layout.with_experts
    return layout
