"""Random weights for a Llama config, written as the checkpoints Loom's loaders read, for
benchmarking loads on a model's real shape (Llama-3-8B) without its weights.

    python bench/make_checkpoint.py configs/llama-3-8b.json /tmp/ck8b \
        --formats safetensors,pt,modelopt,gguf [--dtype bfloat16] [--device cuda] [--shard-gb 4]
        [--gguf-type Q8_0] [--gguf-embed-type Q8_0]

Each format is a directory of OUTDIR with the config as config.json:
  safetensors  model-0000k-of-0000n.safetensors + model.safetensors.index.json
  pt           pytorch_model-0000k-of-0000n.bin (torch.save of a dict of tensors) +
               pytorch_model.bin.index.json (the pt loader reads every *.bin in the directory)
  modelopt     a ModelOpt FP8 export: E4M3 projections with per-tensor fp32 ``weight_scale``
               and ``input_scale``, ``k_scale`` / ``v_scale`` on k_proj / v_proj,
               hf_quant_config.json; embeddings, norms and lm_head (excluded) in --dtype
  gguf         model.gguf, GGUF architecture "llama" as llama.cpp's converter writes it (gguf-py's
               tensor names, q/k rows permuted into llama.cpp's rotary order, which the loader
               undoes; Llama 3.1's rope scaling as rope_freqs): the projections in --gguf-type
               (Q8_0; Q4_0, Q4_1, Q5_0, Q5_1, F16: what gguf-py's numpy quantizer writes),
               token_embd / output in --gguf-embed-type (Q8_0, as `convert_hf_to_gguf.py --outtype
               q8_0` writes them; F16), norms F32. The metadata is what
               loom.testing.gguf_writer writes for llama, from the config; the tokenizer is that
               module's tiny SentencePiece vocabulary (about 300 tokens, ids 0-2 unk/bos/eos,
               which become the config's bos / eos): Loom's GGUF loader takes vocab_size from
               token_embd's rows and `loom bench load` builds no tokenizer, so the file loads
               with the config's vocab_size, but cannot be served as it is. Needs the gguf
               package (imported for this format only).
               Memory: gguf-py's GGUFWriter.add_tensor holds every tensor until it writes; this
               declares each tensor's shape and type up front (add_tensor_info: they follow from
               the config) and streams each tensor's blocks (write_tensor_data) once quantized,
               so the host holds one tensor at a time: the largest in fp32 (the 8B shape's
               embedding, 2.1 GB) and its quantized copy. Quantizing runs gguf-py's
               quants.quantize over row chunks on a thread pool (numpy releases the GIL).

Weights are normal(0, 0.02) and norms 1, drawn tensor by tensor on --device from one seed, so
every format holds the same values (GGUF's quantized). A format's host memory is its current
shard (up to --shard-gb; GGUF: one tensor). A format is written into OUTDIR/.FORMAT.partial and
renamed to OUTDIR/FORMAT once complete, so an existing OUTDIR/FORMAT is always a whole
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import torch
from safetensors.torch import save_file

from loom.layers.quantization.fp8 import FP8, FP8_MAX

FORMATS = ("safetensors", "pt", "modelopt", "gguf")
# GGML types gguf-py's numpy quantizer writes, for the projections and for token_embd / output
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16")
GGUF_EMBED_TYPES = ("Q8_0", "F16")
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


class GGUFFile:
    """``OUTDIR/gguf/model.gguf``, streamed: every tensor's info (name, shape, GGML type) is
    declared from the config before the header is written, then each tensor's data is written
    as it is added, in :func:`llama_tensors`' order."""

    def __init__(self, final: str, config: dict, qtype: str, embed_type: str) -> None:
        import gguf

        from loom.testing.gguf_writer import (
            _llama3_rope_divisors,
            _write_metadata,
            _write_vocab,
            spm_vocab,
        )

        self.gguf, self.final = gguf, final
        self.dir = os.path.join(os.path.dirname(final), ".gguf.partial")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        self.path = os.path.join(self.dir, "model.gguf")
        self.cfg, self.qtype, self.embed_type = config, qtype, embed_type
        hf = hf_namespace(config)
        table = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
        w = self.writer = gguf.GGUFWriter(self.path, "llama")
        w.add_name("random-llama")
        w.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + qtype))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_metadata(w, "llama", hf)
        _write_vocab(w, spm_vocab())
        self.pending: list[tuple[str, gguf.GGMLQuantizationType]] = []  # (HF name, type)
        rope_freqs = None
        if hf.rope_parameters.get("rope_type") == "llama3":
            rope_freqs = _llama3_rope_divisors(hf)
            self._declare("rope_freqs.weight", rope_freqs.shape, gguf.GGMLQuantizationType.F32)
        for name, shape in llama_tensors(config):
            gname = table.get_name(name, try_suffixes=(".weight",))
            assert gname is not None, f"gguf-py has no llama name for {name}"
            if len(shape) == 1:
                kind = "F32"
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                kind = embed_type
            else:
                kind = qtype
            qkind = gguf.GGMLQuantizationType[kind]
            self._declare(gname, shape, qkind)
            self.pending.append((name, qkind))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if rope_freqs is not None:
            w.write_tensor_data(rope_freqs)
        self.pending.reverse()  # popped from the end
        self.threads = os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(self.threads)
        self.total, self.seconds, self.quantizing = 0, 0.0, 0.0

    def _declare(self, name: str, shape: tuple[int, ...], kind) -> None:
        block, size = self.gguf.GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        assert shape[-1] % block == 0, f"{name}: {shape[-1]} columns, {kind.name} blocks {block}"
        nbytes = rows * (shape[-1] // block) * size
        self.writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)

    def _quantize(self, x: np.ndarray, kind) -> np.ndarray:
        """gguf-py's quantizer over row chunks on the pool (rows are independent)."""
        if x.ndim == 1 or kind == self.gguf.GGMLQuantizationType.F32:
            return x
        chunks = np.array_split(x, min(x.shape[0], 4 * self.threads))
        quantize = self.gguf.quants.quantize
        return np.concatenate(list(self.pool.map(lambda c: quantize(c, kind), chunks)))

    def add(self, name: str, w: torch.Tensor) -> None:
        start = time.perf_counter()
        expected, kind = self.pending.pop()
        assert name == expected, f"{name} added where {expected} was declared"
        x = w.float().cpu().numpy()
        heads = {
            "q_proj": self.cfg["num_attention_heads"],
            "k_proj": self.cfg.get("num_key_value_heads") or self.cfg["num_attention_heads"],
        }
        proj = name.split(".")[-2]
        if proj in heads:  # the converter's rotary permutation (the loader undoes it)
            h = heads[proj]
            x = x.reshape(h, 2, x.shape[0] // h // 2, x.shape[1]).swapaxes(1, 2).reshape(x.shape)
        t0 = time.perf_counter()
        q = self._quantize(x, kind)
        self.quantizing += time.perf_counter() - t0
        del x
        self.writer.write_tensor_data(q)
        self.total += q.nbytes
        self.seconds += time.perf_counter() - start

    def close(self) -> None:
        start = time.perf_counter()
        assert not self.pending, f"{len(self.pending)} declared tensors never added"
        self.writer.close()
        self.pool.shutdown()
        size = os.path.getsize(self.path)
        shutil.rmtree(self.final, ignore_errors=True)
        os.replace(self.dir, self.final)
        self.seconds += time.perf_counter() - start
        print(
            f"{self.final}: {size / 1e9:.2f} GB in model.gguf ({self.qtype} projections, "
            f"{self.embed_type} embeddings), {self.seconds:.1f} s ({self.quantizing:.1f} s "
            f"quantizing, {self.threads} threads; "
            f"{self.total / 1e6 / max(self.seconds, 1e-9):.0f} MB/s)",
            flush=True,
        )


def hf_namespace(cfg: dict) -> SimpleNamespace:
    """The config JSON as the attributes loom.testing.gguf_writer reads from an HF config
    (``rope_parameters`` built from ``rope_theta`` / ``rope_scaling`` as transformers 5 does,
    whatever transformers is installed)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    heads = cfg["num_attention_heads"]
    return SimpleNamespace(
        **{
            **cfg,
            "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "rope_parameters": rope,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="an HF Llama config .json (configs/llama-3-8b.json)")
    p.add_argument("outdir")
    p.add_argument("--formats", default="safetensors,pt,modelopt", help=", ".join(FORMATS))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf-type", default="Q8_0", choices=GGUF_TYPES, help="gguf projections")
    p.add_argument(
        "--gguf-embed-type",
        default="Q8_0",
        choices=GGUF_EMBED_TYPES,
        help="gguf token_embd, output",
    )
    ns = p.parse_args()
    formats = ns.formats.split(",")
    if bad := [f for f in formats if f not in FORMATS]:
        p.error(f"unknown formats {bad} (written: {', '.join(FORMATS)})")
    with open(ns.config) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = ns.dtype
    dtype = getattr(torch, ns.dtype)
    os.makedirs(ns.outdir, exist_ok=True)
    limit = int(ns.shard_gb * 1e9)
    writers = [
        GGUFFile(os.path.join(ns.outdir, fmt), cfg, ns.gguf_type, ns.gguf_embed_type)
        if fmt == "gguf"
        else Writer(fmt, os.path.join(ns.outdir, fmt), limit, cfg)
        for fmt in formats
    ]
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
