"""bf16 top-1 agreement with HF transformers for every built-in architecture, on a GPU.

    python bench/arch_parity.py [--json OUT.jsonl] [--num-prompts 8] [--new-tokens 64]
        [--init-range 0.05] [--layers 8] [ARCHITECTURE ...]

Each architecture's tiny test config (``loom.testing.TINY_ARCHITECTURES``: sliding windows and
soft-caps that bind) widened to 8 layers of width 512 with a 32,000-token vocabulary and peaked
random weights (init range 0.05: wider ones make 8 random layers chaotic, so that HF's own bf16
agrees with its fp32 on fewer tokens), windows of 64 tokens against
prompts of 96-160. HF runs eager attention (the one that applies every architecture's caps). Per
architecture, one JSON line:

- ``fp32_top1_vs_hf``: Loom fp32 (default backend) greedy tokens, HF fp32 teacher-forced on them;
- ``bf16_top1_vs_hf``: the same in bf16 on both sides;
- ``fp32_attention_backend`` / ``bf16_attention_backend``: what ``auto`` chose for each;
- ``bf16_hf_top1_vs_fp32_greedy``: HF bf16 against the fp32 greedy path (HF's own noise floor);
- ``hf_sdpa_vs_eager_max_abs``: HF fp32 last-position logits, sdpa against eager.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile

import torch

import loom
from loom.model_loader.base import process_weights_after_loading
from loom.testing import TINY_ARCHITECTURES, tiny_config

WINDOW = 64
ARGS = argparse.Namespace(num_prompts=8, new_tokens=64, init_range=0.05, layers=8)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def widened(arch: str):
    layers = ARGS.layers
    extra = {}
    if arch.startswith("Gemma"):  # three local layers to a global one
        extra["layer_types"] = [
            "full_attention" if i % 4 == 3 else "sliding_attention" for i in range(layers)
        ]
    if arch == "Qwen2ForCausalLM":  # Qwen2's windows start above max_window_layers
        extra["max_window_layers"] = 2
        extra["layer_types"] = [
            "full_attention" if i < 2 else "sliding_attention" for i in range(layers)
        ]
    cfg = tiny_config(
        arch,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        initializer_range=ARGS.init_range,
        max_position_embeddings=4096,
        **extra,
    )
    cfg.head_dim = 64
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = WINDOW
    if getattr(cfg, "attn_logit_softcapping", None):  # Gemma 2's own caps
        cfg.attn_logit_softcapping, cfg.final_logit_softcapping = 50.0, 30.0
    if hasattr(cfg, "mlp_only_layers") and cfg.mlp_only_layers:
        cfg.mlp_only_layers = [cfg.num_hidden_layers - 1]
    if hasattr(cfg, "moe_intermediate_size"):
        cfg.moe_intermediate_size = 256
    if hasattr(cfg, "shared_expert_intermediate_size"):
        cfg.shared_expert_intermediate_size = 512
    return cfg


def hf_model(cfg, dtype: torch.dtype, attn: str = "eager"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        # a copy: the model keeps its config object and reads the attention choice from it
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(cfg), dtype=dtype, attn_implementation=attn
        )
    return model.eval()


def loom_generate(path: str, hf, dtype: str, prompts) -> tuple[list[list[int]], str]:
    """Loom's greedy tokens on HF's weights, and the attention backend(s) ``auto`` chose."""
    with loom.Engine(
        model=path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        cuda_graph_max_bs=8,
        max_total_tokens=65536,
    ) as e:
        skip = ["lm_head.weight"] if hf.config.tie_word_embeddings else []
        with torch.inference_mode():  # in place: CUDA graphs keep pointing at the parameters
            e.runner.model.load_weights((n, t) for n, t in hf.state_dict().items() if n not in skip)
            process_weights_after_loading(e.runner.model)  # the layers' derived copies
        outs = e.generate(
            input_ids=prompts,
            sampling_params={
                "max_new_tokens": ARGS.new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        backend = e.get_server_info()["attention_backend"]
    return [o["output_ids"] for o in outs], backend


@torch.inference_mode()
def top1(hf, prompts, outputs) -> float:
    agree = total = 0
    for p, o in zip(prompts, outputs, strict=True):
        pred = hf(torch.tensor([p + o], device=DEVICE)).logits[0, len(p) - 1 : -1].argmax(-1)
        agree += sum(a == b for a, b in zip(pred.tolist(), o, strict=True))
        total += len(o)
    return agree / total


@torch.inference_mode()
def sdpa_vs_eager(cfg, prompts) -> float | None:
    try:
        sdpa = hf_model(cfg, torch.float32, "sdpa")
    except (ValueError, ImportError):
        return None
    eager = hf_model(cfg, torch.float32)
    worst = 0.0
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        a, b = sdpa(ids).logits[0, -1], eager(ids).logits[0, -1]
        worst = max(worst, (a - b).abs().max().item())
    return worst


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(arch: str, tmp: str) -> dict:
    cfg = widened(arch)
    path = os.path.join(tmp, f"{arch}.json")
    cfg.to_json_file(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, cfg.vocab_size, (int(n),), generator=gen).tolist()
        for n in torch.randint(96, 160, (ARGS.num_prompts,), generator=gen)
    ]
    result = {"architecture": arch}
    hf = hf_model(cfg, torch.float32)
    fp32, result["fp32_attention_backend"] = loom_generate(path, hf, "float32", prompts)
    free()
    result["fp32_top1_vs_hf"] = top1(hf, prompts, fp32)
    del hf
    free()
    hf = hf_model(cfg, torch.bfloat16)
    result["bf16_hf_top1_vs_fp32_greedy"] = top1(hf, prompts, fp32)
    bf16, result["bf16_attention_backend"] = loom_generate(path, hf, "bfloat16", prompts)
    free()
    result["bf16_top1_vs_hf"] = top1(hf, prompts, bf16)
    del hf
    free()
    result["hf_sdpa_vs_eager_max_abs"] = sdpa_vs_eager(cfg, prompts[:2])
    free()
    result.update(vars(ARGS), window=WINDOW)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("architectures", nargs="*", default=list(TINY_ARCHITECTURES))
    p.add_argument("--json", default=None)
    for name, value in vars(ARGS).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ns = p.parse_args()
    for name in vars(ARGS):
        setattr(ARGS, name, getattr(ns, name))
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ns.architectures:
            try:
                result = run(arch, tmp)
            except Exception as exc:  # one architecture's failure must not hide the others'
                result = {"architecture": arch, "error": f"{type(exc).__name__}: {exc}"}
                free()
            line = json.dumps(result)
            print(line, flush=True)
            if ns.json:
                with open(ns.json, "a") as f:
                    f.write(line + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
