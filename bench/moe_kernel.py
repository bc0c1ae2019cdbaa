"""The fused MoE layer's Triton path against its PyTorch path (loom.layers.moe), on a GPU.

    python bench/moe_kernel.py [--tokens 1 16 64 256 1024] [--sweep] [--json OUT.jsonl]
        [--experts 8 --top-k 2 --hidden 4096 --inter 14336]   # Mixtral-8x7B's MoE, bf16

Times each call with CUDA events over a loop of calls: the PyTorch path eagerly (it reads the
per-expert counts on the host), the Triton path eagerly and replayed as a CUDA graph (as Loom's
decode runs it). Prints microseconds per call and the achieved weight-read bandwidth: the bytes
of the experts the batch touches (``3 * H * I`` elements each) over the time, the figure that
matters while a call is a weight-streaming GEMV (small T). ``--sweep`` also times a grid of
block sizes for the Triton path and prints the best per T.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def _time_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _graph_us(fn, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time_us(graph.replay, iters)


def _sweep_configs(default_block_m: int):
    """Block heights around the default one, a few tiles and pipeline depths (36 configs)."""
    from loom.layers.moe.triton_moe import GemmConfig, MoEConfig

    heights = [m for m in (16, 32, 64, 128) if default_block_m // 2 <= m <= 2 * default_block_m]
    for bm, (bn1, bk1), (bn2, bk2), (w, s) in itertools.product(
        heights[:2] if default_block_m == 16 else heights[-2:],
        ((32, 128), (64, 128), (128, 64)),
        ((32, 256), (64, 128), (128, 64)),
        ((4, 4), (8, 3)),
    ):
        yield MoEConfig(bm, GemmConfig(bn1, bk1, w, s), GemmConfig(bn2, bk2, w, s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time a grid of Triton block sizes")
    p.add_argument("--json", help="append one JSON line per T to this file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/moe_kernel.py times CUDA kernels and needs a CUDA GPU; none is visible here.")
        sys.exit(0)

    from loom.layers.moe import FusedMoE, select_experts
    from loom.layers.moe.triton_moe import default_config, fused_experts

    torch.manual_seed(0)
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    moe = FusedMoE(e, h, i).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe.w13.normal_(0.0, h**-0.5)
        moe.w2.normal_(0.0, i**-0.5)
    expert_bytes = 3 * h * i * moe.w13.element_size()
    print(f"{torch.cuda.get_device_name()}  E={e} k={k} H={h} I={i} bf16")
    print(f"{'T':>5} {'experts':>7} {'torch us':>9} {'triton us':>9} {'graph us':>9} "
          f"{'graph GB/s':>10} {'max|diff|':>9}  config")  # fmt: skip
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        weights, ids = select_experts(torch.randn(t, e, device="cuda"), k, renormalize=True)
        touched = int(torch.unique(ids).numel())
        with torch.no_grad():
            ref = moe(x, weights, ids, backend="torch")
            diff = (moe(x, weights, ids, backend="triton") - ref).abs().max().item()
            t_torch = _time_us(lambda: moe(x, weights, ids, backend="torch"), args.iters)  # noqa: B023
            t_triton = _time_us(lambda: moe(x, weights, ids, backend="triton"), args.iters)  # noqa: B023
            t_graph = _graph_us(lambda: moe(x, weights, ids, backend="triton"), args.iters)  # noqa: B023
        gbs = touched * expert_bytes / t_graph / 1e3
        cfg = default_config(t, k, e)
        print(f"{t:>5} {touched:>7} {t_torch:>9.1f} {t_triton:>9.1f} {t_graph:>9.1f} "
              f"{gbs:>10.0f} {diff:>9.2e}  {cfg}")  # fmt: skip
        row = dict(T=t, E=e, k=k, H=h, I=i, experts_touched=touched, torch_us=t_torch)
        row.update(triton_us=t_triton, triton_graph_us=t_graph, weight_gbs=gbs, config=str(cfg))
        if args.sweep:
            best = None
            for c in _sweep_configs(cfg.block_m):
                try:
                    with torch.no_grad():
                        got = fused_experts(x, moe.w13, moe.w2, weights, ids, c)
                        if (got - ref).abs().max().item() > 0.1:
                            continue
                        us = _graph_us(
                            lambda c=c: fused_experts(x, moe.w13, moe.w2, weights, ids, c),  # noqa: B023
                            args.iters,
                        )
                except Exception:  # a tile that does not fit (shared memory, registers)
                    continue
                if best is None or us < best[0]:
                    best = (us, c)
            if best is not None:
                print(f"      best of sweep: {best[0]:.1f} us "
                      f"({touched * expert_bytes / best[0] / 1e3:.0f} GB/s)  {best[1]}")  # fmt: skip
                row.update(sweep_best_us=best[0], sweep_best=str(best[1]))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
