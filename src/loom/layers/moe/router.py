"""Top-k expert routing: router logits ``[tokens, num_experts]`` -> ``(topk_weights, topk_ids)``.

Each architecture's rule is HF transformers' (5.x) ``*TopKRouter.forward``, step for step:
softmax in fp32, ``torch.topk`` (so ties pick the same experts), then
- Mixtral: the k weights always renormalised to sum to 1, and left in fp32 (transformers 5 no
  longer casts them; the expert outputs are multiplied by fp32 weights and rounded once);
- Qwen2-MoE / Qwen3-MoE: renormalised only when ``norm_topk_prob``, then cast to the router
  logits' dtype (the activation dtype), after the renormalisation.

Nothing here reads the host, so routing is CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over ``router_logits [T, E]``, the top ``top_k`` experts of each token,
    their weights optionally renormalised to sum to 1 and then cast to ``weights_dtype`` (None:
    kept in fp32). Returns ``(topk_weights [T, k], topk_ids [T, k] int64)``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        topk_weights = topk_weights.to(weights_dtype)
    return topk_weights, topk_ids


# HF model_type -> (whether to renormalise, given the config; whether the weights take the
# router logits' dtype)
_RULES: dict[str, tuple[Callable[[Any], bool], bool]] = {
    "mixtral": (lambda config: True, False),
    "qwen2_moe": (lambda config: bool(config.norm_topk_prob), True),
    "qwen3_moe": (lambda config: bool(config.norm_topk_prob), True),
}


@dataclass(frozen=True)
class TopKRouting:
    """One architecture's routing rule; ``routing(router_logits) -> (topk_weights, topk_ids)``."""

    top_k: int
    renormalize: bool
    cast_to_logits_dtype: bool

    @classmethod
    def from_config(cls, config: Any) -> TopKRouting:
        """The rule of an HF MoE config (by ``model_type``; top-k is ``num_experts_per_tok``)."""
        rule = _RULES.get(getattr(config, "model_type", None))
        if rule is None:
            raise ValueError(
                f"no routing rule for model_type {getattr(config, 'model_type', None)!r}; "
                f"known: {sorted(_RULES)}"
            )
        renormalize, cast = rule
        return cls(config.num_experts_per_tok, renormalize(config), cast)

    def __call__(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = router_logits.dtype if self.cast_to_logits_dtype else None
        return select_experts(router_logits, self.top_k, self.renormalize, dtype)
