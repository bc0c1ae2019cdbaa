"""Sampling in one Triton kernel on the GPU: temperature, top-k, top-p and min-p filtering and the
draw, with no sort and no host sync.

The plain-PyTorch path (``sampler._sample_full``) launches ~20 kernels per step (softmax, a
full-vocabulary sort, cumsum, masks, a scatter, noise): on the H200 that kept the host busier than
a SmolLM2-sized decode step (docs/benchmarks.md). Here one program per row:

1. finds the row's maximum ``m`` (and its first index: greedy rows stop there) and its smallest
   finite logit;
2. sums ``Z = sum(exp((x - m) / T))``;
3. finds the cut ``tau`` of the kept set ``{x >= tau}`` by a search on the logit: the kept set
   of top-k, top-p and min-p is the intersection of three upper sets of the sorted row, so ``tau``
   is the largest of their three cuts, and ``max(cut_k, cut_p) = sup{tau : count(x >= tau) >= k or
   mass(x >= tau) >= p * Z}`` (both predicates shrink as ``tau`` grows), found in the interval
   above min-p's cut ``m + T log(min_p)``. Each pass over the row tests ``_THRESHOLDS`` evenly
   spaced thresholds at once and keeps the sub-interval where the predicate turns false (an
   8-way test narrows it 9 times a pass, where bisection halves it); the search stops once the
   interval holds a single logit (the kept set is then decided). The first pass also sums Z;
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
from dataclasses import dataclass

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Thresholds tested per pass of the cut search (a power of two: a tl.arange extent). On the H200
# the bisection's ~20 passes over a 128k-entry row cost Llama-3-8B 12% of a batch-32 decode step
# (docs/benchmarks.md, session 5); 8 thresholds need ~7.
_THRESHOLDS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from loom.sampling.penalties import penalised

    @triton.jit
    def _cut_counts(x, m, inv_t, mids, c2, s2, z_vec, it, searching):
        """One block of a cut-search pass: per-lane counts and masses above each threshold,
        and (first pass) the normaliser's partial sums."""
        e = tl.exp((x - m) * inv_t)
        if it == 0:
            z_vec += e
        if searching:
            keep = x[None, :] >= mids[:, None]
            c2 += keep.to(tl.float32)
            s2 += tl.where(keep, e[None, :], 0.0)
        return c2, s2, z_vec

    @triton.jit
    def _sample_kernel(
        Logits,
        Params,  # [5, bs] fp32: temperature, top_p, top_k, min_p, greedy
        Seeds,  # [bs] int64, when HAS_SEEDS
        Out,
        StateRows,  # [bs] int64 penalty-state row (-1: none), when HAS_PEN
        Counts,  # [rows, V] int32 output-token counts
        InPrompt,  # [rows, V] int8
        Coef,  # [3, bs] fp32: frequency, presence, repetition
        BiasPtr,  # [bs + 1] int64 CSR offsets into BiasCols / BiasVals, when HAS_BIAS
        BiasCols,
        BiasVals,
        stride_l,
        stride_p,
        stride_c,
        stride_ip,
        stride_coef,
        base_seed,
        V,
        HAS_SEEDS: tl.constexpr,
        HAS_PEN: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
        SBLOCK: tl.constexpr,
        NT: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = Logits + row * stride_l
        offs = tl.arange(0, BLOCK)
        # 0. penalties, then logit bias, written back in place (the order of the PyTorch path;
        # a grammar's -inf entries applied before stay -inf under both)
        s = -1
        if HAS_PEN:
            s = tl.load(StateRows + row)
            if s >= 0:
                f = tl.load(Coef + row)
                pr = tl.load(Coef + stride_coef + row)
                r = tl.load(Coef + 2 * stride_coef + row)
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    mask = cols < V
                    x = tl.load(base + cols, mask=mask, other=0.0)
                    c = tl.load(Counts + s * stride_c + cols, mask=mask, other=0).to(tl.float32)
                    ip = tl.load(InPrompt + s * stride_ip + cols, mask=mask, other=0)
                    tl.store(base + cols, penalised(x, c, ip, f, pr, r), mask=mask)
                tl.debug_barrier()
        if HAS_BIAS:
            b0 = tl.load(BiasPtr + row)
            b1 = tl.load(BiasPtr + row + 1)
            boffs = tl.arange(0, 16)
            for j in range(b0, b1, 16):  # a row's columns are distinct: no write conflicts
                bmask = j + boffs < b1
                bc = tl.load(BiasCols + j + boffs, mask=bmask, other=0)
                bv = tl.load(BiasVals + j + boffs, mask=bmask, other=0.0)
                x = tl.load(base + bc, mask=bmask, other=0.0)
                tl.store(base + bc, x + bv, mask=bmask)
            tl.debug_barrier()
        # Every pass keeps per-lane partials ([BLOCK] vectors: no cross-thread work inside the
        # loop) and reduces them once at its end.
        # 1. maximum, its first index, smallest finite logit
        m_vec = tl.full([BLOCK], -float("inf"), tl.float32)
        i_vec = tl.zeros([BLOCK], tl.int32)
        lo_vec = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
            up = x > m_vec  # strict: a lane keeps its first maximum
            i_vec = tl.where(up, cols, i_vec)
            m_vec = tl.where(up, x, m_vec)
            lo_vec = tl.minimum(lo_vec, tl.where(x > -float("inf"), x, float("inf")))
        m = tl.max(m_vec, 0)
        best = tl.min(tl.where(m_vec == m, i_vec, V), 0)
        lo = tl.min(lo_vec, 0)
        greedy = tl.load(Params + 4 * stride_p + row)
        if greedy == 0.0:
            temp = tl.load(Params + row)
            top_p = tl.load(Params + stride_p + row)
            top_k = tl.load(Params + 2 * stride_p + row)
            min_p = tl.load(Params + 3 * stride_p + row)
            inv_t = 1.0 / temp
            # 2-3. the normaliser and the cut. The kept set {x >= a} satisfies the predicate
            # (or nothing above min-p's cut does: then that cut stands); {x >= b} keeps
            # nothing. Each pass counts the logits and their mass above NT thresholds that
            # split [a, b) evenly (per-lane partials, [NT, SBLOCK]), so the interval shrinks
            # NT + 1 times a pass, not twice. cnt_a >= count(x >= a) and cnt_b = count(x >=
            # b): once [a, b) holds at most one logit, narrowing it cannot change the set
            # {x >= a}, so the search stops there. The first pass also sums the normaliser.
            tau = lo
            if min_p > 0.0:
                tau = tl.maximum(tau, m + temp * tl.log(min_p))
            use_k = top_k < V
            use_p = top_p < 1.0
            soffs = tl.arange(0, SBLOCK)
            frac = (tl.arange(0, NT) + 1).to(tl.float32) / (NT + 1)
            a = tau
            b = m + 1.0
            cnt_a = V * 1.0
            cnt_b = 0.0
            z = 0.0
            it = 0
            searching = use_k | use_p
            while (it == 0) | (searching & (it < ITERS) & (cnt_a - cnt_b > 1.0)):
                mids = a + (b - a) * frac  # [NT], increasing
                c2 = tl.zeros([NT, SBLOCK], tl.float32)
                s2 = tl.zeros([NT, SBLOCK], tl.float32)
                z_vec = tl.zeros([SBLOCK], tl.float32)
                # Four SBLOCK loads issued before any is used: a pass is bound by load
                # latency (one program per row), so each iteration keeps 4x the bytes in
                # flight and a pass takes a quarter of the iterations.
                for start in range(0, V, 4 * SBLOCK):
                    c0 = start + soffs
                    x0 = tl.load(base + c0, mask=c0 < V, other=-float("inf"))
                    x1 = tl.load(base + c0 + SBLOCK, mask=c0 + SBLOCK < V, other=-float("inf"))
                    x2 = tl.load(
                        base + c0 + 2 * SBLOCK, mask=c0 + 2 * SBLOCK < V, other=-float("inf")
                    )
                    x3 = tl.load(
                        base + c0 + 3 * SBLOCK, mask=c0 + 3 * SBLOCK < V, other=-float("inf")
                    )
                    c2, s2, z_vec = _cut_counts(x0, m, inv_t, mids, c2, s2, z_vec, it, searching)
                    c2, s2, z_vec = _cut_counts(x1, m, inv_t, mids, c2, s2, z_vec, it, searching)
                    c2, s2, z_vec = _cut_counts(x2, m, inv_t, mids, c2, s2, z_vec, it, searching)
                    c2, s2, z_vec = _cut_counts(x3, m, inv_t, mids, c2, s2, z_vec, it, searching)
                if it == 0:
                    z = tl.sum(z_vec, 0)
                if searching:
                    count = tl.sum(c2, 1)  # [NT], non-increasing
                    mass = tl.sum(s2, 1)
                    ok_k = tl.where(use_k, count >= top_k, False)
                    ok = ok_k | tl.where(use_p, mass >= top_p * z, False)
                    # ok holds for a prefix of the thresholds: a moves to the last of it, b to
                    # the first threshold after it
                    a_new = tl.max(tl.where(ok, mids, a), 0)
                    cnt_a = tl.min(tl.where(ok, count, cnt_a), 0)
                    b = tl.min(tl.where(ok, b, mids), 0)
                    cnt_b = tl.max(tl.where(ok, cnt_b, count), 0)
                    a = a_new
                it += 1
            tau = tl.maximum(tau, a)
            # 4. the Gumbel-max draw over {x >= tau}
            if HAS_SEEDS:
                seed = tl.load(Seeds + row)
            else:
                seed = base_seed + row
            t_vec = tl.full([BLOCK], -float("inf"), tl.float32)
            j_vec = tl.zeros([BLOCK], tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                u = tl.rand(seed, cols)
                g = -tl.log(-tl.log(u))
                score = tl.where(x >= tau, (x - m) * inv_t + g, -float("inf"))
                up = score > t_vec
                j_vec = tl.where(up, cols, j_vec)
                t_vec = tl.where(up, score, t_vec)
            top = tl.max(t_vec, 0)
            best = tl.min(tl.where(t_vec == top, j_vec, V), 0)
        tl.store(Out + row, best)
        if HAS_PEN:
            if s >= 0:  # count the token drawn (one state row per batch row)
                tl.atomic_add(Counts + s * stride_c + best, 1)


def enabled(logits: torch.Tensor) -> bool:
    """The fused kernel serves CUDA logits (CPU tests call :func:`fused_sample` directly under
    ``TRITON_INTERPRET=1``); ``LOOM_FUSED_SAMPLING=0`` keeps the PyTorch path."""
    return _ENABLED and logits.is_cuda


_ENABLED = HAS_TRITON and os.environ.get("LOOM_FUSED_SAMPLING", "1") != "0"
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


def row_seed(seed: int, position: int) -> int:
    """A seeded row's Philox seed for one output position (as the PyTorch path's generator)."""
    return (seed * 1_000_003 + position) & _SEED_MASK


@dataclass
class FusedPenalties:
    """What the kernel needs to apply penalties and logit bias itself (``fused_sample``), built
    once per batch (``Scheduler._sampling_plan``). The counts live in a ``PenaltyState``,
    passed at call time (it may have grown since)."""

    state_rows: torch.Tensor | None  # [bs] int64, -1 for rows without penalties
    coef: torch.Tensor | None  # [3, bs] fp32: frequency, presence, repetition (0, 0, 1: none)
    bias_ptr: torch.Tensor | None  # [bs + 1] int64 CSR offsets
    bias_cols: torch.Tensor | None  # int64, distinct within a row
    bias_vals: torch.Tensor | None  # fp32 (-inf for min_new_tokens)

    @classmethod
    def build(
        cls,
        state_rows: list[int] | None,
        coef: list[list[float]] | None,
        bias: list[dict[int, float]] | None,
        device: torch.device,
    ) -> FusedPenalties:
        """``state_rows`` / ``coef`` ([3][bs]) are None without penalties; ``bias``: per row,
        token -> value (None without any)."""

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        out = cls(None, None, None, None, None)
        if state_rows is not None:
            out.state_rows = dev(state_rows, torch.int64)
            out.coef = dev(coef, torch.float32)
        if bias is not None:
            ptr, cols, vals = [0], [], []
            for row in bias:
                for t, v in row.items():
                    cols.append(t)
                    vals.append(v)
                ptr.append(len(cols))
            out.bias_ptr = dev(ptr, torch.int64)
            out.bias_cols = dev(cols, torch.int64)
            out.bias_vals = dev(vals, torch.float32)
        return out


def fused_sample(
    logits: torch.Tensor,
    params: torch.Tensor,
    seeds: list[tuple[int, int, int]] | None = None,
    base_seed: int | None = None,
    iters: int = 12,
    extras: FusedPenalties | None = None,
    state=None,
) -> torch.Tensor:
    """Token ids ``[bs]`` for fp32 ``logits [bs, vocab]`` (row stride may exceed the width).
    ``params`` is ``[5, bs]`` fp32 on the device: temperature, top_p, top_k (the vocabulary
    size when off), min_p, greedy (1.0 / 0.0). ``seeds``: ``(row, seed, output position)`` of
    seeded rows; the others draw from ``base_seed`` (random when None) plus the row index.
    ``iters``: passes of the top-k / top-p cut search, each narrowing the logit range
    ``_THRESHOLDS + 1`` times (12 passes reach fp32 resolution).
    ``extras``: penalties (with ``state``, the ``PenaltyState`` holding the counts, which the
    kernel also advances by the drawn token) and logit bias, applied to ``logits`` in place
    first, in one kernel with the draw."""
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
    has_pen = extras is not None and extras.state_rows is not None
    has_bias = extras is not None and extras.bias_ptr is not None
    counts = state.counts if has_pen else out
    in_prompt = state.in_prompt.view(torch.int8) if has_pen else out
    coef = extras.coef if has_pen else params
    _sample_kernel[(bs,)](
        logits,
        params,
        seed_t,
        out,
        extras.state_rows if has_pen else out,
        counts,
        in_prompt,
        coef,
        extras.bias_ptr if has_bias else out,
        extras.bias_cols if has_bias else out,
        extras.bias_vals if has_bias else params,
        logits.stride(0),
        params.stride(0),
        counts.stride(0),
        in_prompt.stride(0),
        coef.stride(0),
        base_seed,
        vocab,
        HAS_SEEDS=bool(seeds),
        HAS_PEN=has_pen,
        HAS_BIAS=has_bias,
        BLOCK=block,
        SBLOCK=min(block, 1024),
        NT=_THRESHOLDS,
        ITERS=iters,
        num_warps=8,  # one program per row: more warps hide the passes' load and exp latency
    )
    return out
