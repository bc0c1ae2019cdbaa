"""``--quantization modelopt``: FP8 checkpoints exported by NVIDIA's TensorRT Model Optimizer
(``hf_quant_config.json`` with ``quant_algo: FP8``, or a ``quantization_config`` whose
``quant_method`` is ``modelopt``), picked by the checkpoint itself. Its linear layers are the
``fp8`` method's checkpoint layers (E4M3 ``weight``, per-tensor ``weight_scale`` and
``input_scale``); modules its ``exclude_modules`` patterns name stay dense. KV-cache scales
(``k_scale`` / ``v_scale``, with ``kv_cache_quant_algo: FP8``) are loaded and not applied: the
KV cache keeps ``--kv-cache-dtype`` (bf16 by default, where they have no use; Loom's fp8 cache
stores clamped values unscaled). Other algorithms (NVFP4, INT4 AWQ...) are refused by name.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from loom.layers.quantization.base import LinearMethod
from loom.layers.quantization.fp8 import Fp8CheckpointLinearMethod, Fp8Quantization

logger = logging.getLogger(__name__)

KV_SCALES = ("k_scale", "v_scale")


def _config(model_path: str, hf_config: Any) -> dict | None:
    path = os.path.join(model_path, "hf_quant_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f).get("quantization", {})
    qc = getattr(hf_config, "quantization_config", None)
    if qc:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        if qc.get("quant_method") == "modelopt":
            return qc
    return None


def _tensor_names(model_path: str) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in sorted(os.listdir(model_path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, file), framework="pt") as f:
                names += list(f.keys())
    return names


class ModelOptQuantization(Fp8Quantization):
    name = "modelopt"

    def __init__(self, config: dict, kv_scale_names: list[str]) -> None:
        super().__init__(config)
        self.exclude = list(config.get("exclude_modules") or [])
        self.kv_scale_names = kv_scale_names

    @classmethod
    def detects(cls, model_path: str, hf_config: Any) -> bool:
        return os.path.isdir(model_path) and _config(model_path, hf_config) is not None

    @classmethod
    def from_model(cls, model_path: str, hf_config: Any) -> ModelOptQuantization:
        config = _config(model_path, hf_config) if os.path.isdir(model_path) else None
        if config is None:
            raise ValueError(
                f"--quantization modelopt needs a ModelOpt export (hf_quant_config.json); "
                f"{model_path} is not one"
            )
        algo = config.get("quant_algo")
        if algo != "FP8":
            raise ValueError(f"{model_path}: ModelOpt quant_algo {algo!r} is not read (FP8 is)")
        names = [n for n in _tensor_names(model_path) if n.rsplit(".", 1)[-1] in KV_SCALES]
        return cls(config, names)

    def linear_method(self, prefix: str, sources: list[str]) -> LinearMethod | None:
        if any(fnmatch.fnmatch(prefix, p) or prefix.endswith(p) for p in self.exclude):
            return None
        return Fp8CheckpointLinearMethod(static_input=True)

    def apply(self, model: nn.Module) -> int:
        count = super().apply(model)
        modules = dict(model.named_modules())
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        for name in self.kv_scale_names:
            owner, _, attr = name.rpartition(".")
            for fused, parts in packed.items():  # k_proj.k_scale lands on qkv_proj
                for part, _ in parts:
                    owner = owner.replace(f".{part}", f".{fused}")
            module = modules.get(owner)
            if module is None:
                raise ValueError(f"ModelOpt tensor {name}: the model has no module {owner!r}")
            if attr not in module._parameters:
                param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
                param.weight_loader = _load_scalar
                module.register_parameter(attr, param)
        if self.kv_scale_names:
            logger.info(
                "modelopt: %d KV-cache scales loaded, not applied (--kv-cache-dtype decides the "
                "cache)",
                len(self.kv_scale_names),
            )
        return count


def _load_scalar(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    param.data.fill_(float(loaded.reshape(-1)[0]))
