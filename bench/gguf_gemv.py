"""Loom's GGUF-block Triton matmul (loom.layers.quantization.gguf_triton) against a bf16
``torch.matmul`` of the same shape, per GGML type, on a GPU.

    python bench/gguf_gemv.py                 # T=1, N x K in (4096,4096) (14336,4096) (4096,14336)
    python bench/gguf_gemv.py --t 1 4 16 64   # more input rows
    python bench/gguf_gemv.py --sweep         # and the best GEMV configurations (first shape)

Each measurement is a CUDA graph of ``CALLS`` calls, replayed ``REPS`` times between two CUDA
events (launch gaps do not count). The calls cycle over enough copies of the weights to
exceed the L2 cache, so every call reads its weights from memory. GB/s counts the bytes of
weights read (raw GGML blocks; bf16 for the baseline).
"""

from __future__ import annotations

import argparse

import torch

from loom.layers.quantization import gguf_triton
from loom.layers.quantization.gguf_blocks import BLOCKS, dequantize_rows

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
CALLS, REPS = 20, 10
MIN_BYTES = 256 * 2**20  # the copies of the weights a graph cycles over: well above the L2
FP16_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(n: int, k: int, name: str) -> torch.Tensor:
    size, nbytes = BLOCKS[name]
    raw = torch.randint(0, 256, (n, k // size, nbytes), dtype=torch.uint8, device="cuda")
    for off in FP16_FIELDS.get(name, (0,)):
        v = (torch.rand(n, k // size, 1, device="cuda") * 2 - 1) * 1e-3
        raw[..., off : off + 2] = v.to(torch.float16).view(torch.uint8)
    return raw.reshape(n, -1)


def time_us(fn, copies: list) -> float:
    """Microseconds a call, ``fn(copy)`` over ``copies`` in turn, replayed as a CUDA graph."""
    for c in copies[:2]:
        fn(c)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(copies[i % len(copies)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPS * CALLS)


def sweep_configs(t: int):
    for bt in sorted({1, min(4, t), min(8, t)}) if t > 1 else (1,):
        for bn in (4, 8, 16, 32):
            for elems in (256, 512):
                for warps in (4, 8):
                    yield bt, bn, elems, warps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs="+", default=[1])
    ap.add_argument("--types", nargs="+", default=list(BLOCKS))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{'shape':>12} {'T':>3} {'type':>6} {'us':>8} {'GB/s':>7} {'x bf16':>7}  config")
    for n, k in SHAPES:
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        nb = wb.numel() * 2
        bf16_copies = [wb] + [wb.clone() for _ in range(-(-MIN_BYTES // nb) - 1)]
        for t in args.t:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_us(lambda w: torch.matmul(x, w.T), bf16_copies)  # noqa: B023
            print(f"{n:>6}x{k:<5} {t:>3} {'bf16':>6} {t_bf16:8.1f} {nb / t_bf16 / 1e3:7.0f}")
            for name in args.types:
                raw = random_blocks(n, k, name)
                rb = raw.numel()
                copies = [raw] + [raw.clone() for _ in range(-(-MIN_BYTES // rb) - 1)]
                ref = x.float() @ dequantize_rows(raw, name).T
                scale = ref.abs().max().item()

                def run(r, cfg=None):
                    return gguf_triton.gguf_matmul(x, r, name, config=cfg)  # noqa: B023

                err = (run(raw).float() - ref).abs().max().item() / scale
                us = time_us(run, copies)
                print(
                    f"{n:>6}x{k:<5} {t:>3} {name:>6} {us:8.1f} {rb / us / 1e3:7.0f} "
                    f"{t_bf16 / us:7.2f}  default (max err {err:.1e} of max |y|)"
                )
                if not args.sweep or (n, k) != SHAPES[0]:
                    continue
                lw = gguf_triton._group_shape(name)[1]
                results = []
                for bt, bn, elems, warps in sweep_configs(t):
                    cfg = (bt, bn, elems // (2 * lw), warps)
                    us = time_us(lambda r, c=cfg: run(r, c), copies)
                    results.append((us, cfg))
                for us, cfg in sorted(results)[:3]:
                    print(
                        f"{'':>22} sweep {us:8.1f} {rb / us / 1e3:7.0f} {t_bf16 / us:7.2f}  {cfg}"
                    )
            del copies
        del bf16_copies


if __name__ == "__main__":
    main()
