"""A LoRA adapter as PEFT saves it (``adapter_config.json`` plus ``adapter_model.safetensors``
or ``adapter_model.bin``), read into host memory with its scaling folded into B.

Each targeted linear ``W`` becomes ``W x + s * B (A x)`` with ``s = lora_alpha / r`` (``/ sqrt(r)``
with rsLoRA). Folding ``s`` into B makes every module's update ``B' A x``, so per-module ranks
and alphas (PEFT's ``rank_pattern`` / ``alpha_pattern``) need nothing further, and adapters of
different ranks share one zero-padded pool.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

# PEFT's module names for Llama-shaped models, and the packed Loom module each one is a slice of
# (with the slice's index among that module's outputs).
MODULE_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of any module
    digest: str  # sha256 of the checkpoint's files (config and weights)
    # (layer, PEFT module name) -> (A [r, in], B scaled [out, r]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def target_modules(self) -> set[str]:
        return {m for _, m in self.weights}


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: a key applies to a module whose name
    ends with it (as a regular expression) at a name boundary."""
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", module_key):
            return value
    return default


def load_adapter(name: str, path: str) -> LoRAAdapter:
    """Read a PEFT LoRA checkpoint. Raises ValueError naming what is not supported (DoRA,
    trained biases, extra saved modules, embeddings or the LM head as targets)."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    for key, ok in (
        ("use_dora", lambda v: not v),
        ("bias", lambda v: v in (None, "none")),
        ("lora_bias", lambda v: not v),
        ("modules_to_save", lambda v: not v),
        ("fan_in_fan_out", lambda v: not v),
        ("layer_replication", lambda v: not v),
        ("trainable_token_indices", lambda v: not v),
    ):
        if not ok(cfg.get(key)):
            raise ValueError(f"LoRA adapter {name!r}: {key}={cfg[key]!r} is not supported")
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    if not os.path.isfile(st) and not os.path.isfile(pt):
        raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}")
    weights_file = st if os.path.isfile(st) else pt
    try:
        if weights_file == st:
            from safetensors.torch import load_file

            tensors = load_file(st)
        else:
            tensors = torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: safetensors, pickle, OS errors
        raise ValueError(
            f"LoRA adapter {name!r}: cannot read {weights_file!r}: {type(e).__name__}: {e}"
        ) from None
    h = hashlib.sha256()
    for file in (cfg_path, weights_file):
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(block)

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULE_SLICES:
            raise ValueError(
                f"LoRA adapter {name!r}: unsupported weight {key!r} (targets must be the "
                f"attention and MLP projections: {', '.join(MODULE_SLICES)})"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: no LoRA weights in {path!r}")
    base_r, base_alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rslora = bool(cfg.get("use_rslora"))
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B"
            )
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        if b.shape[1] != r:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module}: A and B ranks differ")
        key = f"model.layers.{layer}.{module}"
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, key, base_alpha)
        expected_r = _pattern_value(cfg.get("rank_pattern") or {}, key, base_r)
        if expected_r != r:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module} has rank {r}, config says "
                f"{expected_r}"
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(name, path, rank, h.hexdigest(), weights)
