"""Host and device cost of one sampling call on a GPU, per variant: the greedy argmax, the fused
Triton sampling kernels (loom.sampling.triton_sampling) with and without top-p, penalties, logit
bias and a grammar bitmask, xgrammar's own mask kernel, and an empty Triton launch for scale.
Small models' decode steps are bound by the host, so a sampler's launch cost matters as much as
its kernels.

    python bench/sampling_host.py [RESULTS.jsonl]      # on a CUDA GPU; xgrammar optional

For each (batch, vocabulary) of (16, 49152), (32, 49152), (32, 128256): host us per call (time
to enqueue, synchronising every 8 calls so the launch queue never fills) and device us per call
(CUDA events around calls enqueued behind a sleeping kernel, so they run back to back). One line
per variant; with RESULTS.jsonl, one JSON line each appended there.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def host_us(fn, n=200, every=8):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for i in range(n):
        t = time.perf_counter()
        fn()
        total += time.perf_counter() - t
        if i % every == every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return 1e6 * total / n


def device_us(fn, n=40):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)  # ~0.1 s: every call below is queued before the first runs
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / n


def _one_shape(bs, vocab, dev, xgr) -> list[dict]:
    from loom.sampling.penalties import PenaltyState
    from loom.sampling.sampler import SamplingBatchInfo, argmax_rows
    from loom.sampling.sampling_params import SamplingParams
    from loom.sampling.triton_sampling import FusedPenalties, fused_sample

    rows_out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(bs, vocab, device=dev, generator=gen) * 3
    mask = torch.randint(-(2**31), 2**31 - 1, (bs, (vocab + 31) // 32), device=dev,
                         dtype=torch.int32, generator=gen)  # fmt: skip
    greedy = SamplingBatchInfo.build(
        [SamplingParams(temperature=0.0)] * bs, [0] * bs, vocab, dev, with_params=True
    )
    top_p = SamplingBatchInfo.build(
        [SamplingParams(temperature=0.8, top_p=0.9)] * bs, [0] * bs, vocab, dev
    )
    temp = SamplingBatchInfo.build([SamplingParams(temperature=0.8)] * bs, [0] * bs, vocab, dev)
    state = PenaltyState(vocab, dev, capacity=bs)
    srows = [state.alloc([t % vocab for t in range(i, i + 100)]) for i in range(bs)]
    coef = [[0.5] * bs, [0.3] * bs, [1.1] * bs]
    bias = [{t % vocab: 1.0 for t in range(i, i + 16)} for i in range(bs)]
    extras = FusedPenalties.build(srows, coef, bias, dev)
    work = logits.clone()
    variants = {
        "argmax_rows": lambda: argmax_rows(work),
        "fused greedy_only + mask": lambda: fused_sample(
            work, greedy.params, [], vocab_mask=mask, greedy_only=True
        ),
        "fused greedy, full pipeline + mask": lambda: fused_sample(
            work, greedy.params, [], vocab_mask=mask
        ),
        "fused top_p 0.9": lambda: fused_sample(work, top_p.params, []),
        "fused temperature only (no search)": lambda: fused_sample(
            work, temp.params, [], search=False
        ),
        "fused top_p + penalties + bias": lambda: fused_sample(
            work, top_p.params, [], extras=extras, state=state
        ),
        # search rounds: 3 (the default: a draw left inside the still open interval is settled
        # exactly by the pick kernel) against 6 and 2
        "same, 6 rounds": lambda: fused_sample(
            work, top_p.params, [], extras=extras, state=state, iters=6
        ),
        "same, 2 rounds": lambda: fused_sample(
            work, top_p.params, [], extras=extras, state=state, iters=2
        ),
    }
    if xgr is not None:
        variants["xgrammar apply + argmax_rows"] = lambda: argmax_rows(
            xgr.apply_token_bitmask_inplace(work, mask) or work
        )
    for name, fn in variants.items():
        work.copy_(logits)
        h = host_us(fn)
        work.copy_(logits)
        d = device_us(fn)
        print(f"bs {bs} vocab {vocab} {name}: host {h:.1f} us, device {d:.1f} us", flush=True)
        rows_out.append(
            {
                "bench": "sampling_host",
                "bs": bs,
                "vocab": vocab,
                "variant": name,
                "host_us": h,
                "device_us": d,
            }  # fmt: skip
        )
    return rows_out


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _empty(a, b, c, d, e, f, g, h, i, j, k, n1, n2, n3, n4, n5, X: tl.constexpr):
    pass


def main() -> None:
    out_file = sys.argv[1] if len(sys.argv) > 1 else None
    dev = torch.device("cuda")
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    ts = [torch.empty(8, device=dev) for _ in range(11)]
    rows_out = []
    emp = {
        "triton launch, 16 args": lambda: _empty[(32, 12)](*ts, 1, 2, 3, 4, 5, X=1),
        "torch.empty x1": lambda: torch.empty(4096, device=dev),
    }
    for name, fn in emp.items():
        print(f"{name}: host {host_us(fn):.1f} us", flush=True)
        rows_out.append({"bench": "sampling_host", "variant": name, "host_us": host_us(fn)})
    for bs, vocab in [(16, 49152), (32, 49152), (32, 128256)]:
        rows_out += _one_shape(bs, vocab, dev, xgr)
    if out_file:
        with open(out_file, "a") as f:
            for r in rows_out:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
