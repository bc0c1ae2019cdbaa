"""``--quantization fp8``'s decode matmuls (loom.layers.quantization.fp8_triton) against a bf16
``torch.matmul`` of the same shape, on a GPU with FP8 support (compute capability 8.9+).

    PYTHONPATH=src python bench/fp8_gemv.py              # M = 1 and 4, Llama-3-8B's shapes
    PYTHONPATH=src python bench/fp8_gemv.py --m 1 4 8 16 # the skinny / _scaled_mm crossover
    PYTHONPATH=src python bench/fp8_gemv.py --sweep      # and the best launch configs
    PYTHONPATH=src python bench/fp8_gemv.py --shapes 4096x4096 --m 1 --sweep

Per shape and M: ``bf16`` (cuBLAS), ``gemv`` (the weight-only FP8 GEMV, its default launch),
``quant+mm`` (the fused per-token quantization, then ``torch._scaled_mm``) and ``5op+mm`` (the
same with the five-op PyTorch quantization). Each measurement is a CUDA graph of ``CALLS``
calls, replayed ``REPS`` times between two CUDA events (launch gaps inside the graph count,
host launch overhead does not). The calls cycle over enough copies of the weights to exceed
the L2 cache, so every call reads its weights from memory. GB/s counts the weight bytes read
(E4M3 plus the fp32 scales; bf16 for the baseline). Each fp8 path is checked once per shape
against fp32 sums over the dequantized weights (``err``: max error / max |y|).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from gguf_gemv import time_us  # (run as a script: this folder is on sys.path)

from loom.layers.quantization import fp8_triton
from loom.layers.quantization.fp8 import quantize_rows
from loom.layers.quantization.fp8_triton import TileConfig

# Llama-3-8B: o, qkv, gate_up, down, lm_head (N x K)
SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
MIN_BYTES = 256 * 2**20  # the copies of the weights a graph cycles over: well above the L2


def copies_of(tensors: tuple, nbytes: int) -> list:
    return [tensors] + [
        tuple(t.clone() for t in tensors) for _ in range(-(-MIN_BYTES // nbytes) - 1)
    ]


def gemv_configs():
    """One-row GEMV launches to try: tiles of 2-8 KB (no split-K: the 8B shapes' N gives
    enough programs)."""
    tiles = [(bn, bk) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048, 4096)]
    for (bn, bk), warps, stages in itertools.product(tiles, (4, 8), (2, 3, 4)):
        if 2048 <= bn * bk <= 8192:
            yield TileConfig(bn, bk, 1, warps, stages)


def skinny_configs(split: int):
    grid = itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5))
    for bn, bk, warps, stages in grid:
        yield TileConfig(bn, bk, split, warps, stages)


def sweep(name, fn, configs, check, copies, nbytes: int, t_bf16: float) -> None:
    """Time ``fn(weights, config)`` for each of ``configs`` that passes ``check``; print the
    best three."""
    results = []
    for c in configs:
        try:
            check(fn(copies[0], c).float())
            results.append((time_us(lambda w, c=c: fn(w, c), copies), c))
        except Exception as e:  # noqa: BLE001 - report the config and try the next
            print(f"{'':>13} {c}: {type(e).__name__}: {str(e)[:100]}")
    for us, c in sorted(results)[:3]:
        print(f"{'':>13} {name:>6} {us:7.1f} {nbytes / us / 1e3:7.0f} {t_bf16 / us:7.2f}  {c}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    print(f"{'shape':>13} {'M':>3} {'path':>9} {'us':>8} {'GB/s':>7} {'x bf16':>7}  notes")
    for n, k in (tuple(map(int, s.split("x"))) for s in args.shapes):
        wb = torch.randn(n, k, device="cuda", dtype=dt) / k**0.5
        wq, scale = quantize_rows(wb)
        wd = wq.float() * scale[:, None]
        nb, nq = wb.numel() * 2, wq.numel() + scale.numel() * 4
        bf16_copies = copies_of((wb,), nb)
        fp8_copies = copies_of((wq, scale), nq)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = x.float() @ wd.T
            top = ref.abs().max().item()
            q_ref, s_ref = fp8_triton._quantize_per_token_torch(x)
            ref_q = (q_ref.float() * s_ref) @ wd.T

            def gemv(c, cfg=None):
                return fp8_triton.fp8_gemv(x, c[0], c[1], config=cfg)  # noqa: B023

            def quant_mm(c, quant=fp8_triton.quantize_per_token):
                q, s = quant(x)  # noqa: B023
                return torch._scaled_mm(q, c[0].t(), scale_a=s, scale_b=c[1][None], out_dtype=dt)

            def five_op_mm(c):
                return quant_mm(c, fp8_triton._quantize_per_token_torch)

            def skinny(c, cfg=None):
                return fp8_triton.fp8_skinny(x, c[0], c[1], config=cfg)  # noqa: B023

            scfg = fp8_triton.skinny_config(m, n, k, fp8_triton._num_sms(x.device.index))
            ref_s = fp8_triton.skinny_reference(x, wq, scale, scfg.block_k)

            t_bf16 = time_us(lambda c: torch.matmul(x, c[0].T), bf16_copies)  # noqa: B023
            print(f"{n:>7}x{k:<5} {m:>3} {'bf16':>9} {t_bf16:8.1f} {nb / t_bf16 / 1e3:7.0f}")
            cfg = fp8_triton.gemv_config(n, k, fp8_triton._num_sms(x.device.index))
            runs = [("gemv", gemv, ref, f"{tuple(cfg)}")] if m == 1 else []
            runs += [
                ("skinny", skinny, ref_s, f"{tuple(scfg)}"),
                ("quant+mm", quant_mm, ref_q, ""),
                ("5op+mm", five_op_mm, ref_q, ""),
            ]
            for name, fn, want, note in runs:
                err = (fn(fp8_copies[0]).float() - want).abs().max().item() / top
                us = time_us(fn, fp8_copies)
                print(
                    f"{n:>7}x{k:<5} {m:>3} {name:>9} {us:8.1f} {nq / us / 1e3:7.0f} "
                    f"{t_bf16 / us:7.2f}  err {err:.1e} {note}"
                )
            if not args.sweep:
                continue

            def check(y, bound):
                if (y - ref).abs().max().item() > bound * top:  # noqa: B023
                    raise AssertionError("wrong result")

            if m == 1:
                sweep("gemv", gemv, gemv_configs(), lambda y: check(y, 1e-2),
                      fp8_copies, nq, t_bf16)  # fmt: skip
            sweep("skinny", skinny, skinny_configs(scfg.split_k), lambda y: check(y, 5e-2),
                  fp8_copies, nq, t_bf16)  # fmt: skip
        del bf16_copies, fp8_copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
