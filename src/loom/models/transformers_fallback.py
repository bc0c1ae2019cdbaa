"""The transformers fallback: an architecture with no Loom model file runs through transformers'
own modeling code, with Loom's paged attention in place of HF's.

transformers calls attention through its ``AttentionInterface``: every attention module of a
model that supports it (``_supports_attention_backend``) hands ``(module, q, k, v, mask,
scaling=..., **kwargs)`` to the function registered under ``config._attn_implementation``, and the
model's forward passes its own ``**kwargs`` down to that call. So the HF model is built with the
implementation ``"loom"`` (:func:`loom_attention`), and its forward is called with the flattened
tokens of the batch as one sequence (``[1, num_tokens]``), Loom's positions as ``position_ids``,
and the ``ForwardBatch`` plus this model's :class:`Attention` layers as keyword arguments; the
function routes each call to the Loom layer of the module's ``layer_idx``, which runs the
batch's attention backend over the paged KV pool. Requests never see each other because the
backend attends per request; HF builds no mask (its ``create_causal_mask`` returns None for an
implementation with no registered mask function) and keeps no cache (``use_cache=False``).

Parameter names are HF's (the HF model's top-level modules are this module's own), so
checkpoints load by name. One device only: transformers' layers are not sharded.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.distributed import get_tp_size
from loom.forward_batch import ForwardBatch
from loom.layers.attention.layer import Attention
from loom.models.base import CausalLM

ATTN_IMPLEMENTATION = "loom"  # the name registered with transformers' AttentionInterface
_UNSET = object()


def loom_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    loom_batch: ForwardBatch | None = None,
    loom_layers: nn.ModuleList | None = None,
    sliding_window: Any = _UNSET,
    softcap: Any = _UNSET,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call, run by Loom's paged attention.

    ``query`` is ``[1, heads, num_tokens, head_dim]`` and ``key``/``value`` ``[1, kv_heads,
    num_tokens, head_dim]`` (the batch's tokens flattened into one row, after HF's rotary);
    returns ``[1, num_tokens, heads, head_dim]`` as HF's functions do, and no weights.
    ``attention_mask`` is ignored: the backend masks causally per request, with the layer's
    window. The window and soft-cap HF passes must be the ones the Loom layer was built with
    (the attention backend was chosen for them at start-up)."""
    if loom_batch is None or loom_layers is None:
        raise RuntimeError(
            "the 'loom' attention implementation runs only inside TransformersForCausalLM.forward"
        )
    layer = loom_layers[module.layer_idx]
    if query.shape[0] != 1:
        raise ValueError(f"expected the batch as one row of tokens, got query {tuple(query.shape)}")
    if sliding_window is not _UNSET and (sliding_window or 0) != layer.sliding_window:
        raise ValueError(
            f"layer {layer.layer_id}: transformers attends with sliding_window={sliding_window}, "
            f"Loom's layer was built with {layer.sliding_window or None}"
        )
    if softcap is not _UNSET and float(softcap or 0.0) != layer.logit_cap:
        raise ValueError(
            f"layer {layer.layer_id}: transformers soft-caps at {softcap}, Loom's layer was built "
            f"with {layer.logit_cap or None}"
        )
    if scaling is not None:
        layer.scaling = float(scaling)  # HF's value is authoritative (backends read it per call)
    num_tokens = query.shape[2]
    q = query.transpose(1, 2).reshape(num_tokens, -1)
    k = key.transpose(1, 2).reshape(num_tokens, -1)
    v = value.transpose(1, 2).reshape(num_tokens, -1)
    out = layer(q, k, v, loom_batch)
    return out.view(1, num_tokens, layer.num_heads, layer.head_dim), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, loom_attention)


def _attention_modules(hf: nn.Module) -> dict[int, nn.Module]:
    """HF's attention modules by ``layer_idx``: the modules with a layer index and an
    ``is_causal`` flag (what transformers' attention functions read)."""
    found: dict[int, nn.Module] = {}
    for name, module in hf.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or not hasattr(module, "is_causal"):
            continue
        if idx in found:
            raise ValueError(f"two attention modules claim layer {idx} (one is {name})")
        if not module.is_causal:
            raise ValueError(f"{name} is not causal attention; only decoder-only models serve")
        found[idx] = module
    return found


def _sliding_window(config: Any, module: nn.Module, layer_id: int) -> int | None:
    """The module's own ``sliding_window`` where it keeps one (Mistral, Qwen2, Gemma 2/3), else
    the config's: per ``layer_types`` where it has them, else every layer (Starcoder2)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types and types[layer_id] != "sliding_attention":
        return None
    return window


class TransformersForCausalLM(CausalLM):
    """Any decoder-only architecture transformers implements with its attention interface,
    run through transformers' modeling code (``--model-impl transformers``, or ``auto`` for an
    architecture Loom has no class for)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if get_tp_size() > 1:
            raise ValueError(
                "the transformers fallback runs on one device: tensor parallelism (--tp > 1) "
                "needs a Loom implementation of the architecture"
            )
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        _register_attention()
        # A copy: from_config records the dtype and attention implementation on the config,
        # which the caller may share with an HF model of its own.
        config = copy.deepcopy(config)
        config.use_cache = False
        # Weights are left unwritten (a loader fills them); no_init_weights also skips the
        # tying that init_weights does, so tie afterwards.
        with no_init_weights():
            hf = AutoModelForCausalLM.from_config(
                config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.get_default_dtype()
            )
        hf.tie_weights()
        name = type(hf).__name__
        compatible = type(hf).is_backend_compatible()
        if not compatible or hf.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{name}: transformers' modeling code of this architecture does not support "
                "custom attention functions (_supports_attention_backend), so Loom's paged "
                "attention cannot be plugged in"
            )
        if hf.base_model is hf:
            raise ValueError(f"{name}: no base model to run apart from the LM head")
        if hf._parameters or hf._buffers:
            raise ValueError(f"{name}: tensors outside its submodules are not supported")
        hf.eval()
        self.config = hf.config
        # Not a submodule: its top-level modules are registered as this module's own below, so
        # that parameter names are HF's (checkpoint names).
        object.__setattr__(self, "hf", hf)
        for child_name, child in hf.named_children():
            self.add_module(child_name, child)

        num_layers, num_kv_heads, head_dim = self.kv_cache_shape(config)
        num_heads = config.num_attention_heads
        modules = _attention_modules(hf)
        if sorted(modules) != list(range(num_layers)):
            raise ValueError(
                f"{name}: found attention modules for layers {sorted(modules)}, the config has "
                f"{num_layers} layers"
            )
        layers = []
        for i in range(num_layers):
            module = modules[i]
            groups = getattr(module, "num_key_value_groups", num_heads // num_kv_heads)
            module_head_dim = getattr(module, "head_dim", head_dim)
            if (module_head_dim, groups * num_kv_heads) != (head_dim, num_heads):
                raise ValueError(
                    f"{name}: layer {i} has heads the config does not describe (head_dim "
                    f"{module_head_dim}, {groups} query heads per KV head; the config: "
                    f"head_dim {head_dim}, {num_heads} query and {num_kv_heads} KV heads)"
                )
            cap = getattr(module, "attn_logit_softcapping", None)
            if cap is None:
                cap = getattr(config, "attn_logit_softcapping", None)
            layers.append(
                Attention(
                    i,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    getattr(module, "scaling", None) or head_dim**-0.5,
                    sliding_window=_sliding_window(config, module, i),
                    logit_cap=cap or 0.0,
                )
            )
        self.loom_attention_layers = nn.ModuleList(layers)
        # What HF's ForCausalLM forward does to the head's output: Gemma's soft-cap, Cohere's
        # scale, Granite's divisor.
        self.final_logit_cap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        scale = float(getattr(hf, "logit_scale", None) or 1.0)
        self.logit_scale = scale / float(getattr(config, "logits_scaling", None) or 1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch):
        return self.compute_logits(self.forward_hidden(input_ids, positions, batch), batch)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        out = self.hf.base_model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            loom_batch=batch,
            loom_layers=self.loom_attention_layers,
        )
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not batch.is_decode or batch.logit_indices is not None:
            hidden = hidden[batch.last_token_indices()]
        logits = self.hf.get_output_embeddings()(hidden).float()
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_logit_cap:
            cap = self.final_logit_cap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors by HF name, renamed as transformers renames them on load (its
        ``conversion_mapping``: legacy names, e.g. GPT-NeoX's ``embed_out``, and the base
        model's prefix added or dropped); names transformers declares ignorable and stale copies
        of non-persistent buffers (rotary ``inv_freq``) are skipped. An unknown name raises, a
        tensor that needs one of transformers' converters (experts fused from many tensors)
        raises, and so does a parameter left unwritten."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(self.hf)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        params = dict(self.named_parameters(remove_duplicate=False))
        persistent = self.state_dict(keep_vars=True)  # parameters and persistent buffers
        buffers = {n for n, _ in self.named_buffers(remove_duplicate=False)}
        prefix = self.hf.base_model_prefix
        ignore = [re.compile(p) for p in self.hf._keys_to_ignore_on_load_unexpected or ()]
        written: set[int] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            target, converter = rename_source_key(name, renamings, converters, prefix, persistent)
            if converter is not None:
                raise ValueError(
                    f"checkpoint tensor {name} must be converted by transformers ({converter} -> "
                    f"{target}), which the transformers fallback does not do"
                )
            dest = persistent.get(target)
            if dest is not None:
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model's "
                        f"{target} {tuple(dest.shape)}"
                    )
                with torch.no_grad():
                    dest.copy_(tensor)
                written.add(id(dest))
            elif not (target in buffers or any(p.search(name) for p in ignore)):
                unknown.append(name)
        if unknown:
            raise ValueError(
                f"{type(self.hf).__name__} has no parameters named {sorted(unknown)[:8]} "
                f"({len(unknown)} unknown checkpoint tensors)"
            )
        missing = sorted(n for n, p in params.items() if id(p) not in written)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}")
        return set(params)
