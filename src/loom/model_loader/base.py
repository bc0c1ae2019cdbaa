"""The model_loader family (``--load-format``): turn a model path into config, tokenizer and a
model with weights."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "loom", "transformers")
# The transformers fallback, imported lazily as the registry imports its members: the loaders
# sit below the models.
TRANSFORMERS_FALLBACK = "loom.models.transformers_fallback:TransformersForCausalLM"


@dataclass(frozen=True)
class ModelConfig:
    path: str  # resolved local path (directory, .gguf file or config .json)
    hf_config: Any  # transformers PretrainedConfig
    dtype: torch.dtype
    context_len: int
    architecture: str
    seed: int = 0
    model_impl: str = "auto"  # --model-impl: see resolve_model_class
    # --quantization's QuantizationConfig (loom.layers.quantization.base), or None: dense
    quant_config: Any = None


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device


class ModelLoader(ABC):
    """Loads models of one format.

    Contract: ``load_hf_config`` and ``load_tokenizer`` read only local files (never a hub);
    ``load_model`` returns an ``eval()`` model on ``device_config.device`` in
    ``model_config.dtype`` with every parameter written, built by the model family's class for
    ``model_config.architecture``. ``quantization``: the ``--quantization`` member the format
    implies (None: the flag's, or the checkpoint's own).
    """

    quantization: str | None = None

    @classmethod
    def can_load(cls, path: str) -> bool:
        """Whether this loader understands ``path`` (used by ``--load-format auto``)."""
        return False

    def load_hf_config(self, path: str) -> Any:
        from transformers import AutoConfig, PretrainedConfig

        if path.endswith(".json"):
            with open(path) as f:
                data = json.load(f)
            model_type = data.get("model_type")
            if model_type:
                return AutoConfig.for_model(**data)
            return PretrainedConfig(**data)
        return AutoConfig.from_pretrained(path, local_files_only=True)

    def load_tokenizer(self, path: str) -> Any | None:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            return None
        return AutoTokenizer.from_pretrained(path, local_files_only=True)

    @abstractmethod
    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module: ...


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build tensors in ``dtype`` inside the block (how the loaders build a model)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def process_weights_after_loading(model: nn.Module) -> nn.Module:
    """Let each layer re-layout its loaded weights for the device (called by every loader)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    return model.eval()


def resolve_model_class(architecture: str, model_impl: str = "auto") -> type:
    """The class that builds ``architecture``: with ``auto``, the model family's member of that
    name when one is registered, else the transformers fallback; ``loom`` only the former
    (refusing an architecture Loom does not implement); ``transformers`` always the fallback."""
    from loom import plugins

    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    registered = architecture in plugins.names("model")
    if model_impl == "loom" and not registered:
        raise ValueError(
            f"--model-impl loom: Loom has no implementation of {architecture}; it implements "
            f"{', '.join(sorted(plugins.names('model')))} (--model-impl auto or transformers "
            "runs it through transformers' modeling code)"
        )
    if registered and model_impl != "transformers":
        logger.info("model: %s via Loom's implementation", architecture)
        return plugins.resolve("model", architecture)
    why = "no Loom implementation" if not registered else "--model-impl transformers"
    logger.info("model: %s via transformers' modeling code (%s)", architecture, why)
    module, _, name = TRANSFORMERS_FALLBACK.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
    """Instantiate the architecture's class (:func:`resolve_model_class`), uninitialised, on
    the device, its linear layers given ``model_config.quant_config``'s methods."""
    cls = resolve_model_class(model_config.architecture, model_config.model_impl)
    with default_dtype(model_config.dtype), torch.device(device_config.device):
        model = cls(model_config.hf_config)
        if model_config.quant_config is not None:
            count = model_config.quant_config.apply(model)
            logger.info("%s: %d linear layers quantized", model_config.quant_config.name, count)
    return model
