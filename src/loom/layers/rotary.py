"""Rotary position embeddings (neox / HF "rotate_half" layout), with llama3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from loom.layers.fused_ops import rotary_inplace, use_fused


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
        )
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)"
            )
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # fp32 caches, indexed by position; cast to the activation dtype per call like HF does.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

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
    ):
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        if use_fused(q) and self.rotary_dim == self.head_dim:
            rotary_inplace(q, k, cos, sin, self.head_dim)
            return q, k
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def can_store(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether :meth:`forward_store` can run (the fused kernel; a cache of q's dtype or
        fp8)."""
        return (
            use_fused(q)
            and self.rotary_dim == self.head_dim
            and k_cache.dtype in (q.dtype, torch.float8_e4m3fn, torch.float8_e5m2)
        )

    def forward_store(self, q, k, v, cos_sin, k_cache, v_cache, loc) -> None:
        """Rotate ``q`` in place and write rotated ``k`` and ``v`` into the KV cache at
        ``loc``, in one kernel (check :meth:`can_store` first)."""
        cos, sin = cos_sin
        rotary_inplace(q, k, cos, sin, self.head_dim, v, k_cache, v_cache, loc)


def rope_params(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from an HF config, for transformers 4.x and 5.x layouts."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    theta = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


_ROPE_INSTANCES: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_dim: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    scaling: dict[str, Any] | None = None,
) -> RotaryEmbedding:
    """A shared instance per (shape, scaling, device): layers of a model reuse one cache."""
    device = torch.empty(0).device  # honours an enclosing `with torch.device(...)`
    key = (
        head_dim,
        rotary_dim,
        max_position,
        base,
        repr(sorted((scaling or {}).items())),
        str(device),
    )
    rope = _ROPE_INSTANCES.get(key)
    if rope is None:
        rope = _ROPE_INSTANCES[key] = RotaryEmbedding(
            head_dim, rotary_dim, max_position, base, scaling
        )
    return rope
