"""Random LoRA adapters in PEFT's checkpoint format for a model's shapes, for benchmarks (the
tests make theirs with peft itself; an 8B model is too large to build on the host just to let
peft save an adapter).

python bench/make_lora.py --model configs/llama-3-8b.json --out /tmp/lora-a [--rank 16]
    [--alpha 32] [--targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from loom import plugins
from loom.model_loader.model_path import resolve_model_path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a Llama-shaped config."""
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    i = cfg.intermediate_size
    return {
        "q_proj": (heads * hd, h),
        "k_proj": (kv * hd, h),
        "v_proj": (kv * hd, h),
        "o_proj": (h, heads * hd),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--targets", nargs="+", default=ALL, choices=ALL)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    plugins.ensure_loaded()
    path = resolve_model_path(ns.model)
    # a shape-only config (configs/*.json) is read by the dummy loader
    fmt = "dummy" if path.endswith(".json") else "auto"
    cfg = plugins.resolve("model_loader", fmt)().load_hf_config(path)
    g = torch.Generator().manual_seed(ns.seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in ns.targets:
            n_out, n_in = shapes(cfg)[module]
            part = "self_attn" if module in ALL[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(ns.rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, ns.rank, generator=g) * 0.01
    os.makedirs(ns.out, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, f"{ns.out}/adapter_model.safetensors"
    )
    config = {
        "peft_type": "LORA",
        "r": ns.rank,
        "lora_alpha": ns.alpha,
        "target_modules": ns.targets,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": ns.model,
    }
    with open(f"{ns.out}/adapter_config.json", "w") as f:
        json.dump(config, f, indent=2)
    print(f"{ns.out}: rank {ns.rank}, {len(tensors) // 2} modules")


if __name__ == "__main__":
    main()
