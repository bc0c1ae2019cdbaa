"""Decode attention alone on a GPU, Llama-3-8B's shape (32 query heads, 8 KV heads, head_dim 128,
a bf16 query over a bf16 or fp8_e4m3 cache, every request the same context, one layer): Loom's
Triton decode kernel (loom.layers.attention.triton_ops.decode_attention: 1-16 KV splits, tile
lengths, KV heads a program, warps, pipeline stages, slot prefetch) against FlashInfer's decode
with tensor cores (when it imports), each timed as a CUDA graph, with the bytes of KV read per
second.

python bench/attn_micro.py [RESULTS.jsonl]              # batch x context, 1 x 1,024 to 1,000 x 700
python bench/attn_micro.py --sweep [RESULTS.jsonl]      # launch options at 512 requests x 850
python bench/attn_micro.py --sweep-fp8 [RESULTS.jsonl]  # fp8 tiles and KV heads a program, same

Prints one line per (shape, variant): microseconds per call and GB/s of KV read; with
RESULTS.jsonl, one JSON line per shape appended there.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench_cudagraph

from loom.layers.attention.triton_ops import decode_attention

HQ, HK, D = 32, 8, 128


def setup(bs: int, ctx: int, kv_dtype=torch.bfloat16):
    slots = bs * ctx + 1
    k = torch.randn(slots, HK, D, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    v = torch.randn(slots, HK, D, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    perm = torch.randperm(slots - 1, device="cuda") + 1
    table = perm.view(bs, ctx).contiguous()
    q = torch.randn(bs, HQ, D, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(bs, device="cuda")
    lens = torch.full((bs,), ctx, device="cuda", dtype=torch.int64)
    return q, k, v, table, rows, lens


def triton_time(bs, ctx, splits, dot, kv_dtype=torch.bfloat16, block_n=None, launch=None):
    q, k, v, table, rows, lens = setup(bs, ctx, kv_dtype)
    mid_o = torch.empty(bs, HQ, splits, D, device="cuda", dtype=torch.float32)
    mid_l = torch.empty(bs, HQ, splits, device="cuda", dtype=torch.float32)
    out = torch.empty_like(q)

    def fn():
        decode_attention(
            q, k, v, table, rows, lens, D**-0.5, splits, mid_o, mid_l, out, dot, block_n,
            **(launch or {}),
        )  # fmt: skip

    fn()
    return do_bench_cudagraph(fn, rep=50)


def flashinfer_time(bs, ctx, kv_dtype=torch.bfloat16):
    import flashinfer

    q, k, v, table, rows, lens = setup(bs, ctx, kv_dtype)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.arange(bs + 1, dtype=torch.int32) * ctx
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.zeros(bs * ctx, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device="cuda"),
    )
    w.plan(
        indptr,
        table.flatten().to(torch.int32),
        torch.ones(bs, dtype=torch.int32),
        HQ,
        HK,
        D,
        1,
        q_data_type=torch.bfloat16,
        kv_data_type=kv_dtype,
    )
    kv = (k.view(-1, 1, HK, D), v.view(-1, 1, HK, D))

    def fn():
        w.run(q, kv)

    fn()
    return do_bench_cudagraph(fn, rep=50)


SHAPES = [(1, 1024), (64, 1024), (256, 900), (512, 900), (1000, 700)]


def main() -> None:
    """Each shape runs in a process of its own: a CUDA fault is sticky, and one kernel's fault
    must not fail the rows after it."""
    import subprocess

    if len(sys.argv) > 1 and sys.argv[1] == "--sweep":
        return sweep(sys.argv[2] if len(sys.argv) > 2 else None)
    if len(sys.argv) > 1 and sys.argv[1] == "--sweep-fp8":
        return sweep_fp8(sys.argv[2] if len(sys.argv) > 2 else None)
    if len(sys.argv) > 2 and sys.argv[1] == "--row":
        return run_row(
            int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None
        )
    results = sys.argv[1] if len(sys.argv) > 1 else None
    for bs, ctx in SHAPES:
        cmd = [sys.executable, __file__, "--row", str(bs), str(ctx)] + (
            [results] if results else []
        )
        done = subprocess.run(cmd, capture_output=True, text=True)
        out = done.stdout.strip() or f"bs {bs:4d} ctx {ctx:5d}: failed"
        print(out if done.returncode == 0 else f"{out}\n  {done.stderr.strip()[-300:]}", flush=True)


def run_row(bs: int, ctx: int, results: str | None) -> None:
    """One shape: every Triton variant, then FlashInfer (last: a fault there is sticky)."""
    try:
        import flashinfer  # noqa: F401

        have_fi = True
    except Exception:  # noqa: BLE001
        have_fi = False
    times: dict = {}
    kv_kinds = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for kind, kv_dtype in kv_kinds.items():
        for splits in (1, 2, 4, 8, 16):
            name = f"{kind}-triton-{splits}"
            try:
                times[name] = triton_time(bs, ctx, splits, True, kv_dtype) * 1000
            except Exception as e:  # noqa: BLE001
                times[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
    # Tile and launch variants at each shape's best split count (1 from batch 64, else 16):
    # 128-token tiles carry twice the bytes per load round trip; more warps or pipeline stages
    # keep more loads in flight per SM; prefetching the next tile's slots takes one round trip
    # out of each iteration.
    splits = 1 if bs >= 64 else 16
    variants = {
        "n128": (128, None),
        "w8": (None, {"num_warps": 8}),
        "n128-w8": (128, {"num_warps": 8}),
        "s2": (None, {"num_stages": 2}),
        "s4": (None, {"num_stages": 4}),
        "pf": (None, {"prefetch": True}),
        "n128-pf": (128, {"prefetch": True}),
        # several KV heads a program: one slot lookup per token for all of them, and each
        # token's heads read as one contiguous run (fp8: 128 bytes a head)
        "kv2": (None, {"kv_per_program": 2}),
        "kv4": (None, {"kv_per_program": 4}),
        "kv8": (32, {"kv_per_program": 8}),
        "kv4-w8": (None, {"kv_per_program": 4, "num_warps": 8}),
    }
    for kind, kv_dtype in kv_kinds.items():
        for tag, (block_n, launch) in variants.items():
            name = f"{kind}-triton-{splits}-{tag}"
            try:
                times[name] = triton_time(bs, ctx, splits, True, kv_dtype, block_n, launch) * 1000
            except Exception as e:  # noqa: BLE001
                times[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
    if have_fi:
        for kind, kv_dtype in kv_kinds.items():
            try:
                times[f"{kind}-flashinfer"] = flashinfer_time(bs, ctx, kv_dtype) * 1000
            except Exception as e:  # noqa: BLE001
                times[f"{kind}-flashinfer"] = f"error: {type(e).__name__}: {str(e)[:80]}"
    for k, v in times.items():
        _print_row(bs, ctx, k, v, 18)
    _record(results, "attn_micro", bs, ctx, times)


def _print_row(bs: int, ctx: int, name: str, v, width: int) -> None:
    """One variant's time (us) and the KV bytes it read per second, or its error."""
    kv_bytes = bs * ctx * HK * D * 2 * (1 if name.startswith("fp8") else 2)
    cell = f"{v:8.1f} us ({kv_bytes / v / 1e3:5.0f} GB/s)" if isinstance(v, float) else v
    print(f"bs {bs:4d} ctx {ctx:5d} {name:{width}s} {cell}", flush=True)


def _record(results: str | None, bench: str, bs: int, ctx: int, times: dict) -> None:
    if results:
        with open(results, "a") as f:
            f.write(json.dumps({"bench": bench, "bs": bs, "ctx": ctx, **times}) + "\n")


def _run_sweep(runs, results: str | None, bench: str, bs: int, ctx: int, width: int) -> None:
    """Time each (name, KV dtype, tile length, launch options) at one split, print and record."""
    times = {}
    for name, kv_dtype, bn, launch in runs:
        try:
            times[name] = triton_time(bs, ctx, 1, True, kv_dtype, bn, launch) * 1000
        except Exception as e:  # noqa: BLE001
            times[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
        _print_row(bs, ctx, name, times[name], width)
    _record(results, bench, bs, ctx, times)


def sweep(results: str | None, bs: int = 512, ctx: int = 850) -> None:
    """The decode kernel's tile and launch options at the 1000-request 8B workload's mean decode
    step (batch ~540 over ~840 tokens; one split): over an fp8 cache every combination of KV
    heads a program, tile length, warps, pipeline stages and slot prefetch; over bf16 the
    default against two heads a program."""
    import itertools

    fp8 = torch.float8_e4m3fn
    runs = [("bf16-kv1", torch.bfloat16, None, {}), ("bf16-kv2", torch.bfloat16, None,
            {"kv_per_program": 2}), ("fp8-kv1", fp8, None, {})]  # fmt: skip
    for bn, warps, stages, pf in itertools.product((64, 128), (4, 8), (None, 2, 4), (0, 1)):
        launch = {"kv_per_program": 2, "prefetch": bool(pf)}
        launch |= {k: v for k, v in (("num_warps", warps), ("num_stages", stages)) if v}
        runs.append((f"fp8-kv2-n{bn}-w{warps}-s{stages or 'd'}-pf{pf}", fp8, bn, launch))
    _run_sweep(runs, results, "attn_sweep", bs, ctx, 28)


def sweep_fp8(results: str | None, bs: int = 512, ctx: int = 850) -> None:
    """What holds the fp8 decode below bf16's bytes per second: smaller tiles and four KV heads a
    program (fewer registers a program: more programs an SM), all with slot prefetch; bf16 and
    the fp8 default (two heads, 64-token tiles, 4 warps) as the references."""
    import itertools

    fp8 = torch.float8_e4m3fn
    runs = [
        ("bf16-kv1", torch.bfloat16, None, {}),
        ("fp8-kv2-n64-w4 (default)", fp8, 64, {"kv_per_program": 2, "prefetch": True}),
    ]
    for kvp, bn, warps in itertools.product((2, 4), (16, 32, 64), (4, 8)):
        launch = {"kv_per_program": kvp, "prefetch": True, "num_warps": warps}
        runs.append((f"fp8-kv{kvp}-n{bn}-w{warps}", fp8, bn, launch))
    _run_sweep(runs, results, "attn_sweep_fp8", bs, ctx, 32)


if __name__ == "__main__":
    main()
