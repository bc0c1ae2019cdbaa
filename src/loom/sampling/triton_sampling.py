"""Sampling in one Triton kernel on the GPU: temperature, top-k, top-p and min-p filtering and the
draw, with no sort and no host sync.

The plain-PyTorch path (``sampler._sample_full``) launches ~20 kernels per step (softmax, a
full-vocabulary sort, cumsum, masks, a scatter, noise): on the H200 that kept the host busier than
a SmolLM2-sized decode step (docs/benchmarks.md). Here one program per row:

1. finds the row's maximum ``m`` (and its first index: greedy rows stop there) and its smallest
   finite logit;
2. sums ``Z = sum(exp((x - m) / T))``;
3. finds the cut ``tau`` of the kept set ``{x >= tau}`` by bisection on the logit: the kept set
   of top-k, top-p and min-p is the intersection of three upper sets of the sorted row, so ``tau``
   is the largest of their three cuts, and ``max(cut_k, cut_p) = sup{tau : count(x >= tau) >= k or
   mass(x >= tau) >= p * Z}`` (both predicates shrink as ``tau`` grows), found in 32 halvings;
   min-p's cut is ``m + T log(min_p)``;
4. draws ``argmax((x - m) / T + G)`` over the kept set with Gumbel noise ``G`` (the Gumbel-max
   trick, equivalent to the exponential race of the PyTorch path) from Triton's Philox generator,
   seeded per row: a seeded request's noise depends only on its seed and output position.

Semantics equal the sort-based reference except on exact ties at a cut (the reference keeps an
arbitrary subset of tied tokens, this keeps them all). Tested against the reference
distribution with chi-square tests (tests/test_sampler.py, on CPU under Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import random

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_kernel(
        Logits,
        Params,  # [5, bs] fp32: temperature, top_p, top_k, min_p, greedy
        Seeds,  # [bs] int64, when HAS_SEEDS
        Out,
        stride_l,
        stride_p,
        base_seed,
        V,
        HAS_SEEDS: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = Logits + row * stride_l
        offs = tl.arange(0, BLOCK)
        # 1. maximum, its first index, smallest finite logit
        m = -float("inf")
        lo = float("inf")
        best = 0
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, cols, V), 0)
            best = tl.where(bm > m, bi, best)
            m = tl.maximum(m, bm)
            lo = tl.minimum(lo, tl.min(tl.where(x > -float("inf"), x, float("inf")), 0))
        greedy = tl.load(Params + 4 * stride_p + row)
        if greedy == 0.0:
            temp = tl.load(Params + row)
            top_p = tl.load(Params + stride_p + row)
            top_k = tl.load(Params + 2 * stride_p + row)
            min_p = tl.load(Params + 3 * stride_p + row)
            inv_t = 1.0 / temp
            # 2. the normaliser
            z = 0.0
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                z += tl.sum(tl.exp((x - m) * inv_t), 0)
            # 3. the cut
            tau = lo
            if min_p > 0.0:
                tau = tl.maximum(tau, m + temp * tl.log(min_p))
            use_k = top_k < V
            use_p = top_p < 1.0
            if use_k | use_p:
                a = lo  # the kept set {x >= a} satisfies the predicate (or nothing does)
                b = m + 1.0  # keeps nothing
                for _ in range(ITERS):
                    mid = 0.5 * (a + b)
                    count = 0.0
                    mass = 0.0
                    for start in range(0, V, BLOCK):
                        cols = start + offs
                        x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                        keep = x >= mid
                        count += tl.sum(keep.to(tl.float32), 0)
                        mass += tl.sum(tl.where(keep, tl.exp((x - m) * inv_t), 0.0), 0)
                    ok = (use_k & (count >= top_k)) | (use_p & (mass >= top_p * z))
                    a = tl.where(ok, mid, a)
                    b = tl.where(ok, b, mid)
                tau = tl.maximum(tau, a)
            # 4. the Gumbel-max draw over {x >= tau}
            if HAS_SEEDS:
                seed = tl.load(Seeds + row)
            else:
                seed = base_seed + row
            top = -float("inf")
            best = 0
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                u = tl.rand(seed, cols)
                g = -tl.log(-tl.log(u))
                score = tl.where(x >= tau, (x - m) * inv_t + g, -float("inf"))
                bs_ = tl.max(score, 0)
                bi = tl.min(tl.where(score == bs_, cols, V), 0)
                best = tl.where(bs_ > top, bi, best)
                top = tl.maximum(top, bs_)
        tl.store(Out + row, best)


def enabled(logits: torch.Tensor) -> bool:
    """The fused kernel serves CUDA logits (CPU tests call :func:`fused_sample` directly under
    ``TRITON_INTERPRET=1``); ``LOOM_FUSED_SAMPLING=0`` keeps the PyTorch path."""
    return _ENABLED and logits.is_cuda


_ENABLED = HAS_TRITON and os.environ.get("LOOM_FUSED_SAMPLING", "1") != "0"
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


def row_seed(seed: int, position: int) -> int:
    """A seeded row's Philox seed for one output position (as the PyTorch path's generator)."""
    return (seed * 1_000_003 + position) & _SEED_MASK


def fused_sample(
    logits: torch.Tensor,
    params: torch.Tensor,
    seeds: list[tuple[int, int, int]] | None = None,
    base_seed: int | None = None,
    iters: int = 32,
) -> torch.Tensor:
    """Token ids ``[bs]`` for fp32 ``logits [bs, vocab]`` (row stride may exceed the width).
    ``params`` is ``[5, bs]`` fp32 on the device: temperature, top_p, top_k (the vocabulary
    size when off), min_p, greedy (1.0 / 0.0). ``seeds``: ``(row, seed, output position)`` of
    seeded rows; the others draw from ``base_seed`` (random when None) plus the row index.
    ``iters``: bisection halvings of the logit range (32 reach fp32 resolution)."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    if base_seed is None:
        base_seed = random.getrandbits(62)
    seed_t = out  # unused unless seeded
    if seeds:
        per_row = [(base_seed + r) & _SEED_MASK for r in range(bs)]
        for row, seed, position in seeds:
            per_row[row] = row_seed(seed, position)
        seed_t = torch.tensor(per_row, dtype=torch.int64).to(logits.device, non_blocking=True)
    block = min(4096, triton.next_power_of_2(vocab))
    _sample_kernel[(bs,)](
        logits,
        params,
        seed_t,
        out,
        logits.stride(0),
        params.stride(0),
        base_seed,
        vocab,
        HAS_SEEDS=bool(seeds),
        BLOCK=block,
        ITERS=iters,
    )
    return out
