"""Rotary position embeddings (neox / HF "rotate_half" layout) with every rope scaling HF configs
carry: default, linear, dynamic, yarn, llama3 and longrope (Phi-3's "su").

Frequencies and the attention factor (a multiplier on cos and sin: yarn, longrope) come from
transformers' ``ROPE_INIT_FUNCTIONS``; this module turns them into fp32 cos/sin tables indexed by
position. The KV cache is paged and a key is rotated once, when it is written, so row ``p`` of a
table must not depend on how long the sequence later grows. For the two types whose frequencies HF
makes depend on the sequence length, row ``p`` holds what HF's cached token-by-token generation
uses for the token at position ``p``:

- ``dynamic``: rows ``p < max_position_embeddings`` use the unscaled frequencies; rows at or beyond
  it the frequencies HF computes for ``seq_len = p + 1``. (HF's threshold for this type is the
  config's ``max_position_embeddings``; it ignores ``original_max_position_embeddings``.)
- ``longrope``: rows ``p < original_max_position_embeddings`` use ``short_factor``, rows at or
  beyond it ``long_factor``; every row carries HF's attention factor.

Where this differs from HF: HF's forward over a whole sequence of length ``S`` above the threshold
rotates all ``S`` positions with one set, the ``seq_len = S`` frequencies (dynamic) or
``long_factor`` (longrope), positions below the threshold included. HF's ``generate`` prefills a
prompt that way, so for a prompt longer than the threshold its cached keys differ from Loom's;
prompts within the threshold, and tokens fed one at a time, match.

A model's context length (``context_length``) is ``max_position_embeddings``, or ``factor`` times
the pre-scaling length when that is longer for linear, dynamic and yarn (vLLM's rule): their
configs keep the pre-scaling length in ``max_position_embeddings`` (yarn: in
``original_max_position_embeddings``), while llama3 and longrope configs state the extended length
there, and so do Gemma 3's (whose global layers scale linearly). A model's tables cover that
length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loom.layers.fused_ops import rotary_inplace, use_fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's name in transformers 4.x configs
# Types whose ``factor`` stretches the context past the pre-scaling length.
_CONTEXT_EXTENDING = ("linear", "dynamic", "yarn")


def _rope_parameters(scaling: dict[str, Any] | None) -> dict[str, Any]:
    """The scaling dict with ``rope_type`` set (from the 4.x key ``type`` or an alias), less
    ``rope_theta`` and ``partial_rotary_factor``, which the caller passes as ``base`` and
    ``rotary_dim``."""
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    dropped = ("type", "rope_theta", "partial_rotary_factor")
    params = {k: v for k, v in scaling.items() if k not in dropped}
    params["rope_type"] = rope_type
    return params


def _hf_config(rotary_dim: int, max_position: int, base: float, params: dict[str, Any]) -> Any:
    """A transformers config with the fields transformers 5's ``ROPE_INIT_FUNCTIONS`` read. Its
    head is the rotated part (``rotary_dim`` already applies ``partial_rotary_factor``)."""
    from transformers import PreTrainedConfig

    config = PreTrainedConfig()
    config.hidden_size = config.head_dim = rotary_dim
    config.num_attention_heads = 1
    config.max_position_embeddings = max_position
    config.rope_parameters = {**params, "rope_theta": base}
    return config


def _default_parameters(
    config: Any, device: Any = None, seq_len: Any = None
) -> tuple[torch.Tensor, float]:
    """Unscaled rope, in ``ROPE_INIT_FUNCTIONS``' signature (transformers 5 keeps it per model)."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (config.rope_parameters["rope_theta"] ** exponent), 1.0


def _dynamic_rows(init: Callable, config: Any, inv_freq: torch.Tensor, num_positions: int):
    threshold = config.max_position_embeddings
    if num_positions <= threshold:
        return inv_freq
    # One call for all rows, seq_len [rows, 1] in fp64. HF computes the scaled base in seq_len's
    # dtype: an int seq_len takes the default dtype (bf16 while a loader builds the model), and
    # fp32's vectorized pow lands up to 3.4e-7 relative from the scalar pow HF runs per token,
    # fp64 rounded to fp32 within 2e-7 (measured).
    seq_len = torch.arange(threshold + 1, num_positions + 1, dtype=torch.float64)[:, None]
    scaled, _ = init(config, seq_len=seq_len)
    return torch.cat((inv_freq.expand(threshold, -1), scaled.float()))


def _longrope_rows(init: Callable, config: Any, inv_freq: torch.Tensor, num_positions: int):
    original = config.rope_parameters["original_max_position_embeddings"]
    long_inv_freq, _ = init(config, seq_len=original + 1)
    is_long = torch.arange(num_positions)[:, None] >= original
    return torch.where(is_long, long_inv_freq, inv_freq)


# Types whose frequencies vary with position: a [num_positions, rotary_dim / 2] table of them.
_POSITION_DEPENDENT: dict[str, Callable] = {"dynamic": _dynamic_rows, "longrope": _longrope_rows}


def _num_positions(rope_type: str, max_position: int, params: dict[str, Any]) -> int:
    if rope_type not in _CONTEXT_EXTENDING or not params.get("factor"):
        return max_position
    original = max_position
    if rope_type == "yarn":
        original = params.get("original_max_position_embeddings", max_position)
    return max(max_position, math.ceil(params["factor"] * original))


def context_length(config: Any) -> int:
    """The longest sequence ``config``'s positions cover (the module's docstring gives the
    rule); with rope parameters per layer type, the longest of them."""
    base = getattr(config, "max_position_embeddings", None) or 2048
    if str(getattr(config, "model_type", "")).startswith("gemma3"):
        return base
    params = getattr(config, "rope_parameters", None)
    kinds = (
        [k for k, v in params.items() if isinstance(v, dict)] if isinstance(params, dict) else []
    )
    lengths = [base]
    for kind in kinds or [None]:
        _, scaling = rope_params(config, kind)
        if scaling is not None:
            lengths.append(_num_positions(scaling["rope_type"], base, scaling))
    return max(lengths)


def _cos_sin_tables(
    rotary_dim: int,
    max_position: int,
    base: float,
    params: dict[str, Any],
    num_positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[num_positions, rotary_dim / 2]`` cos and sin tables, attention factor applied
    (``num_positions``: by default the length the scaling stretches ``max_position`` to)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params["rope_type"]
    init = {**ROPE_INIT_FUNCTIONS, "default": _default_parameters}[rope_type]
    config = _hf_config(rotary_dim, max_position, base, params)
    if num_positions is None:
        num_positions = _num_positions(rope_type, max_position, params)
    inv_freq, attention_factor = init(config)
    rows = _POSITION_DEPENDENT.get(rope_type)
    if rows is not None:
        inv_freq = rows(init, config, inv_freq, num_positions)
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """Rotary embedding of the first ``rotary_dim`` dims of each head. ``max_position`` is the
    model config's ``max_position_embeddings`` (HF's rope functions read it). ``scaling``: the
    HF rope parameters (4.x ``rope_scaling`` or 5.x ``rope_parameters``), None for plain rope.
    The table covers ``num_positions`` positions (the model's ``context_length``), by default
    the length ``scaling`` stretches ``max_position`` to."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
        num_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        params = _rope_parameters(scaling)
        self.rope_type = params["rope_type"]
        device = torch.empty(0).device  # honours an enclosing `with torch.device(...)`
        # Built on the CPU, so every device holds the same table.
        with torch.device("cpu"):
            cos, sin = _cos_sin_tables(rotary_dim, max_position, float(base), params, num_positions)
        self.num_positions = cos.shape[0]
        # fp32 caches, indexed by position; cast to the activation dtype per call like HF does.
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim < self.head_dim:
            out = torch.cat((out, x[..., self.rotary_dim :]), dim=-1)
        return out.view(num_tokens, -1)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for ``positions``, computed once per forward and shared by every layer."""
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(dtype)
        return cos, sin

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ):
        """``qk_norm`` (q weight, k weight, eps: an RMSNorm over each head, applied first)
        only where :meth:`fuses` says the kernel runs."""
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        if self.fuses(q):
            rotary_inplace(q, k, cos, sin, self.head_dim, qk_norm=qk_norm)
            return q, k
        assert qk_norm is None, "the q/k norm is fused only into the kernel"
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def fuses(self, q: torch.Tensor) -> bool:
        """Whether the fused kernel rotates ``q`` (it may then apply the q/k norm too)."""
        return use_fused(q) and self.rotary_dim == self.head_dim

    def can_store(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether :meth:`forward_store` can run (the fused kernel; a cache of q's dtype or
        fp8)."""
        return self.fuses(q) and k_cache.dtype in (q.dtype, torch.float8_e4m3fn, torch.float8_e5m2)

    def forward_store(self, q, k, v, cos_sin, k_cache, v_cache, loc, qk_norm=None) -> None:
        """Rotate ``q`` in place and write rotated ``k`` and ``v`` into the KV cache at
        ``loc``, in one kernel (check :meth:`can_store` first); ``qk_norm`` as in
        :meth:`forward`."""
        cos, sin = cos_sin
        rotary_inplace(q, k, cos, sin, self.head_dim, v, k_cache, v_cache, loc, qk_norm)


def rope_params(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, rope parameters or None for plain rope) from an HF config, for transformers 4.x
    (``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) layouts. ``layer_type``
    picks one entry of per-layer-type parameters (5.x Gemma 3: ``"full_attention"``,
    ``"sliding_attention"``)."""
    params = getattr(config, "rope_parameters", None)
    default_theta = getattr(config, "rope_theta", None) or 10000.0
    if isinstance(params, dict) and params:
        nested = [k for k, v in params.items() if isinstance(v, dict)]
        if nested and layer_type is None:
            raise ValueError(f"rope parameters are per layer type {nested}: pass layer_type")
        if nested:
            params = params[layer_type]
        params = dict(params or {})
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta") or default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    # Phi-3 keeps its pre-training length outside the rope dict; transformers 5 gives it priority.
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None and rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = original
    return theta, params


_ROPE_INSTANCES: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    num_positions: int | None = None,
) -> RotaryEmbedding:
    """A shared instance per table and device: layers of a model reuse one cache. The key holds
    every argument the table depends on (the scaling dict normalized, so ``type``/``rope_type``
    spellings share)."""
    device = torch.empty(0).device  # honours an enclosing `with torch.device(...)`
    params = _rope_parameters(scaling)
    key = (
        head_dim,
        rotary_dim,
        max_position,
        float(base),
        repr(sorted(params.items())),
        num_positions,
        str(device),
    )
    rope = _ROPE_INSTANCES.get(key)
    if rope is None:
        rope = _ROPE_INSTANCES[key] = RotaryEmbedding(
            head_dim, rotary_dim, max_position, base, scaling, num_positions
        )
    return rope
