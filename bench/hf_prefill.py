"""HF transformers' prefill rate on the default model, the peer of ``loom bench latency``'s
prefill: one forward over INPUT_LEN random prompt ids (fp32, the GGUF dequantised as HF loads
it), best of RUNS, as a JSON line.

    python bench/hf_prefill.py HF_DIR [--input-len 512] [--runs 3] [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

from loom.bench import append_result


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, ns.input_len), generator=g)
    model(ids)  # warm-up
    best = float("inf")
    for _ in range(ns.runs):
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
        best = min(best, time.perf_counter() - start)
    result = {
        "peer": "hf-transformers",
        "input_len": ns.input_len,
        "prefill_s": best,
        "prefill_tokens_per_s": ns.input_len / best,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    append_result(ns.result_file, result)


if __name__ == "__main__":
    main()
