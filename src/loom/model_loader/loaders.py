"""Built-in loaders: auto, safetensors, bitsandbytes, pt, dummy (gguf lives in gguf_loader.py)."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from loom import plugins
from loom.model_loader.base import (
    DeviceConfig,
    ModelConfig,
    ModelLoader,
    build_model,
    process_weights_after_loading,
    resolve_model_class,
)


def _safetensors_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []


def _count_tensors(path: str) -> int:
    """Tensors in the directory's safetensors files (their headers only)."""
    from safetensors import safe_open

    total = 0
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def _checkpoint_tensors(model_config: ModelConfig, weights):
    """The checkpoint's tensors as the quantization member, if any, regroups them."""
    quant = model_config.quant_config
    return weights if quant is None else quant.checkpoint_tensors(weights)


class SafetensorsLoader(ModelLoader):
    """An HF directory: config.json, *.safetensors and tokenizer files. Quantized weights
    (``fp8``, ``modelopt``, ``bitsandbytes``: a quantized checkpoint, or quantizing at load)
    of Loom's own implementations load one decoder layer at a time, as ``--load-format
    layered`` does."""

    @classmethod
    def can_load(cls, path: str) -> bool:
        return bool(_safetensors_files(path))

    def iterate_weights(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        files = _safetensors_files(path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        if self._layer_by_layer(model_config):
            from loom.model_loader.layered import LayeredLoader

            return LayeredLoader().load_model(model_config, device_config)
        model = build_model(model_config, device_config)
        weights = tqdm(
            self.iterate_weights(model_config.path),
            total=_count_tensors(model_config.path),
            desc="Loading safetensors",
            unit="tensor",
            leave=False,
        )
        model.load_weights(_checkpoint_tensors(model_config, weights))
        return process_weights_after_loading(model)

    # Quantized weights, from a quantized checkpoint or quantized at load: built whole, the
    # model holds every layer's dense weights before any is quantized (Llama-3-8B shape on the
    # H200: a peak of 1.78x the FP8 weights either way, 2.68x the NF4 ones), where one layer at
    # a time holds the quantized weights and one dense layer (1.00x from a ModelOpt export,
    # 1.04x quantizing to FP8, 1.08x to NF4, in the same time or less).
    LAYERED_QUANTIZATION = ("fp8", "modelopt", "bitsandbytes")

    def _layer_by_layer(self, model_config: ModelConfig) -> bool:
        from loom.model_loader.layered import FALLBACK_MODULE, LayeredLoader

        quant = model_config.quant_config
        if isinstance(self, LayeredLoader) or quant is None:
            return False
        if quant.name not in self.LAYERED_QUANTIZATION:
            return False
        cls = resolve_model_class(model_config.architecture, model_config.model_impl)
        return cls.__module__ != FALLBACK_MODULE


class BitsAndBytesLoader(SafetensorsLoader):
    """SGLang's ``--load-format bitsandbytes``: an HF safetensors directory loaded with
    ``--quantization bitsandbytes`` (a bitsandbytes checkpoint read as stored, a dense one
    quantized to 4-bit NF4 at load). ``auto`` never picks it: the safetensors loader reads the
    same directories, and a bitsandbytes checkpoint selects its quantization by itself."""

    quantization = "bitsandbytes"

    @classmethod
    def can_load(cls, path: str) -> bool:
        return False


def _pt_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return []
    return sorted(
        f for pattern in ("*.bin", "*.pt") for f in glob.glob(os.path.join(path, pattern))
    )


class PtLoader(ModelLoader):
    """An HF directory whose weights are PyTorch pickles (``pytorch_model*.bin``, ``*.pt``),
    read with ``torch.load(weights_only=True)``: tensors and plain containers only, so a file
    that would run code when unpickled is refused. ``auto`` picks it when there are no
    safetensors files."""

    @classmethod
    def can_load(cls, path: str) -> bool:
        return bool(_pt_files(path)) and not _safetensors_files(path)

    def iterate_weights(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        files = _pt_files(path)
        if not files:
            raise FileNotFoundError(f"no *.bin or *.pt files in {path}")
        for file in files:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise ValueError(
                    f"{file}: not a weights-only PyTorch checkpoint (torch.load with "
                    f"weights_only=True refused it: {e})"
                ) from e
            if not isinstance(state, dict):
                raise ValueError(f"{file}: holds a {type(state).__name__}, not a state dict")
            yield from state.items()

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        model = build_model(model_config, device_config)
        weights = tqdm(
            self.iterate_weights(model_config.path),
            desc="Loading PyTorch weights",
            unit="tensor",
            leave=False,
        )
        model.load_weights(_checkpoint_tensors(model_config, weights))
        return process_weights_after_loading(model)


class DummyLoader(ModelLoader):
    """Random weights from a config (a directory or a config .json), for benchmarks."""

    @classmethod
    def can_load(cls, path: str) -> bool:
        return False  # never picked by auto: random weights must be asked for

    def load_tokenizer(self, path: str):
        try:
            return super().load_tokenizer(path)
        except Exception:
            return None

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        model = build_model(model_config, device_config)
        gen = torch.Generator(device=device_config.device).manual_seed(model_config.seed)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.data.fill_(1.0)
            else:  # small values keep activations finite through many layers
                param.data.uniform_(-0.02, 0.02, generator=gen)
        return process_weights_after_loading(model)


class AutoLoader(ModelLoader):
    """Picks the first registered loader whose ``can_load`` accepts the path."""

    def __init__(self) -> None:
        self._picked: dict[str, ModelLoader] = {}  # one loader per path, so it can keep state

    def _pick(self, path: str) -> ModelLoader:
        if path not in self._picked:
            self._picked[path] = self._find(path)
        return self._picked[path]

    def _find(self, path: str) -> ModelLoader:
        for entry in plugins.entries("model_loader"):
            if entry.name == "auto":
                continue
            try:
                cls = plugins.resolve("model_loader", entry.name)
            except plugins.RegistryError:
                continue
            if isinstance(cls, type) and cls.can_load(path):
                return cls()
        raise ValueError(
            f"no model loader recognises {path!r}; pass --load-format "
            f"({', '.join(plugins.names('model_loader'))})"
        )

    def load_hf_config(self, path):
        return self._pick(path).load_hf_config(path)

    def load_tokenizer(self, path):
        return self._pick(path).load_tokenizer(path)

    def load_model(self, model_config, device_config):
        return self._pick(model_config.path).load_model(model_config, device_config)
