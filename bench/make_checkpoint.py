"""Random weights for a Llama config, written as the checkpoints Loom's loaders read, for
benchmarking loads on a model's real shape (Llama-3-8B) without its weights.

    python bench/make_checkpoint.py configs/llama-3-8b.json /tmp/ck8b \
        --formats safetensors,pt,modelopt [--dtype bfloat16] [--device cuda] [--shard-gb 4]

Each format is a directory of OUTDIR with the config as config.json:
  safetensors  model-0000k-of-0000n.safetensors + model.safetensors.index.json
  pt           pytorch_model-0000k-of-0000n.bin (torch.save of a dict of tensors) +
               pytorch_model.bin.index.json (the pt loader reads every *.bin in the directory)
  modelopt     a ModelOpt FP8 export: E4M3 projections with per-tensor fp32 ``weight_scale``
               and ``input_scale``, ``k_scale`` / ``v_scale`` on k_proj / v_proj,
               hf_quant_config.json; embeddings, norms and lm_head (excluded) in --dtype
GGUF is not written: src/loom/testing/gguf_writer.py converts a whole HF nn.Module and needs a
vocabulary of vocab_size tokens, and gguf-py's writer holds every tensor until it writes.

Weights are normal(0, 0.02) and norms 1, drawn tensor by tensor on --device from one seed, so
every format holds the same values. A format's host memory is its current shard (up to
--shard-gb). A format is written into OUTDIR/.FORMAT.partial and renamed to OUTDIR/FORMAT once
complete, so an existing OUTDIR/FORMAT is always a whole checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from loom.layers.quantization.fp8 import FP8, FP8_MAX

FORMATS = ("safetensors", "pt", "modelopt")
ST_NAMES = ("model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json")
NAMES = {  # format -> (shard file name, index file name)
    "safetensors": ST_NAMES,
    "modelopt": ST_NAMES,
    "pt": ("pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}
MODELOPT = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}


def llama_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of a Llama checkpoint, in HF's order."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (heads * hd, h)),
            (p + "self_attn.k_proj.weight", (kv * hd, h)),
            (p + "self_attn.v_proj.weight", (kv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, h)))
    return out


def modelopt_tensors(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """``w`` as a ModelOpt FP8 export stores it (projections E4M3 with per-tensor scales)."""
    if not name.endswith("_proj.weight"):
        return {name: w}
    scale = w.abs().max().float() / FP8_MAX
    stem = name.removesuffix("weight")
    out = {
        name: (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8),
        stem + "weight_scale": scale.reshape(()),
        stem + "input_scale": torch.tensor(0.02),
    }
    if ".k_proj." in name or ".v_proj." in name:
        out[stem + ("k_scale" if ".k_proj." in name else "v_scale")] = torch.tensor(1.0)
    return out


class Writer:
    """One format's directory: shards of up to ``limit`` bytes, then the index and renames."""

    def __init__(self, fmt: str, final: str, limit: int, config: dict) -> None:
        self.fmt, self.final, self.limit = fmt, final, limit
        self.dir = os.path.join(os.path.dirname(final), f".{fmt}.partial")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = self.total = 0
        self.files: list[list[str]] = []  # each shard's tensor names
        self.seconds = 0.0

    def add(self, name: str, w: torch.Tensor) -> None:
        start = time.perf_counter()
        tensors = modelopt_tensors(name, w) if self.fmt == "modelopt" else {name: w}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.shard and self.shard_bytes + size > self.limit:
            self.flush()
        for k, t in tensors.items():
            self.shard[k] = t.cpu()
        self.shard_bytes += size
        self.seconds += time.perf_counter() - start

    def flush(self) -> None:
        path = os.path.join(self.dir, f"shard-{len(self.files):05d}")
        if self.fmt == "pt":
            torch.save(self.shard, path)
        else:
            save_file(self.shard, path, metadata={"format": "pt"})
        self.files.append(list(self.shard))
        self.total += self.shard_bytes
        self.shard, self.shard_bytes = {}, 0

    def close(self) -> None:
        start = time.perf_counter()
        if self.shard:
            self.flush()
        n, weight_map = len(self.files), {}
        for k, names in enumerate(self.files):
            name = NAMES[self.fmt][0].format(k + 1, n)
            os.replace(os.path.join(self.dir, f"shard-{k:05d}"), os.path.join(self.dir, name))
            weight_map.update(dict.fromkeys(names, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        with open(os.path.join(self.dir, NAMES[self.fmt][1]), "w") as f:
            json.dump(index, f, indent=2)
        if self.fmt == "modelopt":
            producer = {"name": "modelopt", "version": "0.27.0"}
            with open(os.path.join(self.dir, "hf_quant_config.json"), "w") as f:
                json.dump({"producer": producer, "quantization": MODELOPT}, f, indent=2)
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.dir, self.final)
        self.seconds += time.perf_counter() - start
        gb = self.total / 1e9
        print(f"{self.final}: {gb:.2f} GB in {n} files, {self.seconds:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="an HF Llama config .json (configs/llama-3-8b.json)")
    p.add_argument("outdir")
    p.add_argument("--formats", default="safetensors,pt,modelopt", help=", ".join(FORMATS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    formats = ns.formats.split(",")
    if bad := [f for f in formats if f not in FORMATS]:
        p.error(f"unknown formats {bad} (written: {', '.join(FORMATS)}; gguf is not: see --help)")
    with open(ns.config) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = ns.dtype
    dtype = getattr(torch, ns.dtype)
    os.makedirs(ns.outdir, exist_ok=True)
    limit = int(ns.shard_gb * 1e9)
    writers = [Writer(fmt, os.path.join(ns.outdir, fmt), limit, cfg) for fmt in formats]
    gen = torch.Generator(device=ns.device).manual_seed(ns.seed)
    start, draw = time.perf_counter(), 0.0
    for name, shape in llama_tensors(cfg):
        t0 = time.perf_counter()
        if name.endswith("norm.weight"):
            w = torch.ones(shape, dtype=dtype, device=ns.device)
        else:
            w = torch.empty(shape, dtype=dtype, device=ns.device).normal_(0, 0.02, generator=gen)
        if w.is_cuda:
            torch.cuda.synchronize(w.device)
        draw += time.perf_counter() - t0
        for writer in writers:
            writer.add(name, w)
    for writer in writers:
        writer.close()
    print(f"drawing {draw:.1f} s; {time.perf_counter() - start:.1f} s in all", flush=True)


if __name__ == "__main__":
    main()
