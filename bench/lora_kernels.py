"""Multi-LoRA on one projection, on a GPU: the Triton kernels (loom.lora.triton_ops, gather and
segment variants) against today's torch path (``LoRALinear``'s loop over slot groups) and the
base matmul alone, for Llama-3-8B's packed projections.

    python bench/lora_kernels.py [--tokens 1 64 256] [--slots 1 8 64] [--rank 16]
        [--shapes qkv o gate_up down] [--iters 200] [--graph]

For each shape x token count x distinct slots (tokens in equal runs, one slot a run, as
requests' tokens come), times with CUDA events, per call in microseconds:

- base:    ``F.linear(x, W)``
- torch:   ``LoRALinear.forward`` (base + per-slot index_select / matmuls / index_add_)
- gather / segment: base + ``lora_shrink`` + ``lora_expand`` with that kernel pair
- auto:    base + ``lora_shrink_expand`` (its own choice between the two)

``--graph`` times each as a CUDA graph of ``--iters`` calls, so launch gaps do not count (as for
captured decode steps); without it, eager calls back to back. The LoRA columns' excess over base
is the adapters' cost; ``err`` is the largest |auto - torch| (bf16 rounding only).
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# (in, slice sizes) of Llama-3-8B's packed projections
SHAPES = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
PACKED = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 64], help="distinct adapters")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--graph", action="store_true", help="time CUDA graph replays")
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or min(args.slots) < 1 or args.rank < 1 or args.iters < 1:
        p.error("--tokens, --slots, --rank and --iters must be positive")
    return args


def slot_runs(t: int, distinct: int) -> list[int]:
    """``t`` tokens in ``min(t, distinct)`` near-equal runs, run i on slot i."""
    d = min(t, distinct)
    return [i * d // t for i in range(t)]


def time_us(fn, iters: int, warmup: int, graph: bool) -> float:
    """Mean microseconds per call of ``fn`` over ``iters`` calls, by CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()  # warm
        torch.cuda.synchronize()
        start.record()
        g.replay()
        end.record()
    else:
        start.record()
        for _ in range(iters):
            fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def bench_case(name, t, distinct, args, dtype) -> dict:
    from loom.lora import triton_ops as ops
    from loom.lora.backends import TorchNativeLoRABackend
    from loom.lora.batch import make_lora_batch
    from loom.lora.manager import LoRALinear, LoRAManager

    n_in, sizes = SHAPES[name]
    n_out, s_count, r = sum(sizes), len(sizes), args.rank
    dev = torch.device("cuda")
    num_slots = max(args.slots)
    # pool as LoRAManager lays it out: block-diagonal B, scaled so the update is O(1)
    a_buf = torch.randn(num_slots, s_count * r, n_in, device=dev, dtype=dtype) / n_in**0.5
    b_buf = torch.zeros(num_slots, n_out, s_count * r, device=dev, dtype=dtype)
    row = 0
    for j, size in enumerate(sizes):
        b_buf[:, row : row + size, j * r : (j + 1) * r] = (
            torch.randn(num_slots, size, r, device=dev, dtype=dtype) / r**0.5
        )
        row += size
    base = torch.nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dtype)
    x = torch.randn(t, n_in, device=dev, dtype=dtype)
    slots = slot_runs(t, distinct)

    # today's torch path: LoRALinear over a stand-in manager holding this one pool
    mgr = SimpleNamespace(
        device=dev,
        active=None,
        buffers=[{PACKED[name]: (a_buf, b_buf)}],
        sizes={PACKED[name]: (n_in, list(sizes))},
        backend=TorchNativeLoRABackend(),
    )
    LoRAManager.set_batch(mgr, slots)
    lora_linear = LoRALinear(base, mgr, 0, PACKED[name])

    batch = make_lora_batch(slots, dev)
    offs = [sum(sizes[:j]) for j in range(s_count)]

    def kernels(segments):
        def fn():
            y = F.linear(x, base.weight)
            v = ops.lora_shrink(
                x, a_buf, batch.token_slot, s_count, segments=segments, reduce=False
            )
            ops.lora_expand(v, b_buf, batch.token_slot, offs, y, segments=segments)
            return y

        return fn

    def auto():
        y = F.linear(x, base.weight)
        return ops.lora_shrink_expand(x, y, a_buf, b_buf, sizes, batch)

    err = (auto().float() - lora_linear(x).float()).abs().max().item()
    row = {"shape": name, "T": t, "slots": min(t, distinct), "err": err}
    for col, fn in (
        ("base", lambda: F.linear(x, base.weight)),
        ("torch", lambda: lora_linear(x)),
        ("gather", kernels(None)),
        ("segment", kernels(batch.segments)),
        ("auto", auto),
    ):
        row[col] = time_us(fn, args.iters, args.warmup, args.graph)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/lora_kernels.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    cols = ["base", "torch", "gather", "segment", "auto"]
    mode = "CUDA graph replay" if args.graph else "eager"
    print(f"# {torch.cuda.get_device_name()}, {args.dtype}, rank {args.rank}, {mode}, us per call")
    print(f"{'shape':8} {'T':>5} {'slots':>5} " + " ".join(f"{c:>8}" for c in cols) + "      err")
    for name in args.shapes:
        for t in args.tokens:
            for distinct in sorted({min(t, d) for d in args.slots}):
                row = bench_case(name, t, distinct, args, dtype)
                vals = " ".join(f"{row[c]:8.1f}" for c in cols)
                print(f"{name:8} {t:5d} {row['slots']:5d} {vals} {row['err']:8.2e}", flush=True)


if __name__ == "__main__":
    main()
