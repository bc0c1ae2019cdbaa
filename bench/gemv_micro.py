"""cuBLAS (``F.linear``) against Loom's Triton GEMV (loom.layers.gemv) for one-token decode, per
weight shape, on a GPU; for the Triton GEMV the best of its 44 configurations per shape.

    python bench/gemv_micro.py [RESULTS.jsonl]   # Llama-3-8B's and SmolLM2-135M's shapes, bf16

Times each as a CUDA graph of repeated calls (``triton.testing.do_bench_cudagraph``), so launch
gaps do not count, and prints the achieved read bandwidth (weight bytes / time).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton.testing

from loom.layers.gemv import gemv

SHAPES = {
    "llama-3-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "smollm2-135m": {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    },
}
CONFIGS = [
    (bn, bk, w, s)
    for bn in (2, 4, 8, 16)
    for bk in (256, 512, 1024)
    for w in (4, 8)
    for s in (2, 3, 4)
    if bn * bk <= 8192
]


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    dt = torch.bfloat16
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
            x = torch.randn(1, k, device="cuda", dtype=dt)
            nbytes = w.numel() * w.element_size()
            t_cublas = triton.testing.do_bench_cudagraph(lambda: F.linear(x, w))  # noqa: B023
            best = None
            ref = F.linear(x.float(), w.float())
            for cfg in CONFIGS:
                try:
                    y = gemv(x, w, config=cfg)
                    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)
                    t = triton.testing.do_bench_cudagraph(lambda: gemv(x, w, config=cfg))  # noqa: B023
                except Exception as e:  # noqa: BLE001 - report and try the next config
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t_best, cfg = best
            row = {
                "bench": "gemv",
                "model": model,
                "layer": name,
                "n": n,
                "k": k,
                "cublas_us": 1000 * t_cublas,
                "triton_us": 1000 * t_best,
                "best_config": cfg,
                "cublas_GBps": nbytes / t_cublas / 1e6,
                "triton_GBps": nbytes / t_best / 1e6,
            }
            print(
                f"{model:13s} {name:8s} [{n}x{k}] cuBLAS {row['cublas_us']:8.1f} us "
                f"({row['cublas_GBps']:6.0f} GB/s)  Triton {row['triton_us']:8.1f} us "
                f"({row['triton_GBps']:6.0f} GB/s) {cfg}"
            )
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
