from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def live(model: nn.Module, params: dict[str, nn.Parameter], name: str) -> nn.Parameter | None:
    """``params[name]``, or the module's current parameter of that name when the one in
    ``params`` was on the meta device and has since been given storage (``--load-format
    layered`` materialises a layer's parameters while its checkpoint tensors stream in). The
    current one is not kept in ``params``: a layer quantized after loading frees its dense
    weight, which a reference here would keep alive."""
    param = params.get(name)
    if param is not None and param.is_meta:
        param = model.get_parameter(name)
    return param


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, list[tuple[str, str | int]]],
    skip: Iterable[str] = (),
) -> set[str]:
    """Route HF-named checkpoint tensors into ``model``'s (possibly fused) parameters.

    ``packed_modules_mapping`` maps a fused module name to its checkpoint parts and their shard
    ids, e.g. ``{"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}``. Names that
    contain any string in ``skip`` are ignored. Returns the parameter names that were loaded; an
    unknown checkpoint name raises, so a wrong mapping never loads silently.
    """
    params = dict(model.named_parameters())
    parts = [
        (f".{part}.", f".{fused}.", shard)
        for fused, members in packed_modules_mapping.items()
        for part, shard in members
    ]
    skip = tuple(skip)
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        target, shard = next(
            ((name.replace(part, fused), sid) for part, fused, sid in parts if part in name),
            (name, None),
        )
        param = live(model, params, target)
        if param is None:
            raise KeyError(
                f"checkpoint tensor {name!r} has no parameter {target!r} in {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor.to(param.dtype), shard) if shard is not None else loader(
            param, tensor.to(param.dtype)
        )
        loaded.add(target)
    return loaded
