"""Sampling in a few Triton kernels on the GPU: penalties, logit bias, temperature, top-k, top-p
and min-p filtering and the draw, with no sort and no host sync.

The plain-PyTorch path (``sampler._sample_full``) launches ~20 kernels per step (softmax, a
full-vocabulary sort, cumsum, masks, a scatter, noise): on the H200 that kept the host busier than
a SmolLM2-sized decode step (docs/benchmarks.md). Here each row is split into chunks of
``_CHUNK`` columns, one program per (row, chunk), so a batch of 32 rows fills the GPU; programs
of a row exchange per-chunk partials between launches (a fixed number, so no host sync):

1. ``_prep_kernel`` applies the penalties and the logit bias in place, then finds its chunk's
   maximum, the maximum's first index and the smallest finite logit; the row's ``m`` (and, for
   greedy rows, the token) follows from the chunks';
2. ``_round_kernel`` (``iters`` launches) searches the cut ``tau`` of the kept set
   ``{x >= tau}``: the kept set of top-k, top-p and min-p is the intersection of three upper sets
   of the sorted row, so ``tau`` is the largest of their three cuts, and ``max(cut_k, cut_p) =
   sup{tau : count(x >= tau) >= k or mass(x >= tau) >= p * Z}`` (both predicates shrink as
   ``tau`` grows), found in the interval above min-p's cut ``m + T log(min_p)``. Each round
   counts, per chunk, the logits and their mass ``exp((x - m) / T)`` above ``_THRESHOLDS``
   evenly spaced thresholds; the next round merges the chunks' counts and keeps the
   sub-interval where the predicate turns false (17 times narrower). The first round also sums
   the normaliser ``Z``. A row stops searching once its interval holds a single logit (the kept
   set is then decided). Three rounds leave the interval ~5,000 times narrower than the row's
   range; a row whose interval still holds several logits draws over ``{x >= a}``, a superset of
   the kept set, and the pick kernel settles a draw that lands in ``[a, b)`` exactly (rejection
   sampling: check the cut's definition at the drawn logit, redraw above it if it fails); an
   interval holding a single value (a tie, as bf16 logits often have at a top-k cut) is kept
   whole and needs no check;
3. ``_draw_kernel`` takes the last step and draws ``argmax((x - m) / T + G)`` over the kept set in
   its chunk, with Gumbel noise ``G`` (the Gumbel-max trick, equivalent to the exponential race
   of the PyTorch path) from Triton's Philox generator (four columns an evaluation), seeded per
   row and column: a seeded request's noise depends only on its seed and output position;
4. ``_pick_kernel`` takes each row's best chunk (settling a draw inside an open interval, see
   2.) and counts the drawn token for the penalties.

Every sum runs in a fixed order over fixed chunks, so a row's result does not depend on the
batch it is in.

Semantics equal the sort-based reference except on exact ties at a cut (the reference keeps an
arbitrary subset of tied tokens, this keeps them all). Tested against the reference
distribution with chi-square tests (tests/test_sampler.py, on CPU under Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import math
import random
from dataclasses import dataclass

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Thresholds tested per round of the cut search (a power of two: a tl.arange extent); a round
# narrows the interval 17 times.
_THRESHOLDS = 16
# Columns per program: a row is split into chunks of this many, one program each, so that a
# batch of 32 rows of Llama-3-8B's 128,256-entry vocabulary runs 1,024 programs a launch. On the
# H200 one program per row (32 programs on 132 SMs) was bound by load latency: ~1 us per loop
# iteration, +0.65-0.97 ms per 8B step at batch 32 (docs/benchmarks.md).
_CHUNK = 4096
# Integer arguments that change from step to step: the random base seed, and the row strides of
# the [k, bs] parameter rows (the batch size). Triton would specialise its compiled variants on
# them (value 1, divisibility by 16), so a seed divisible by 16 or a batch shrinking from 16 to
# 15 compiled a new variant in the middle of serving: on the H200 a py-spy profile of SmolLM2's
# constrained batch-16 steps spent 28% of its sampling samples in Triton's compiler
# (docs/benchmarks.md).
_PER_STEP = ("base_seed", "stride_p", "stride_coef")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from loom.sampling.penalties import penalised

    @triton.jit(do_not_specialize=_PER_STEP)
    def _prep_kernel(
        Logits,
        StateRows,  # [bs] int64 penalty-state row (-1: none), when HAS_PEN
        Counts,  # [rows, V] int32 output-token counts
        InPrompt,  # [rows, V] int8
        Coef,  # [3, bs] fp32: frequency, presence, repetition
        BiasPtr,  # [bs + 1] int64 CSR offsets into BiasCols / BiasVals, when HAS_BIAS
        BiasCols,
        BiasVals,
        Mask,  # [bs, W] int32 grammar bitmask (bit set: allowed), when HAS_MASK
        Stats,  # [bs, P, 3] fp32: the chunk's maximum, its first index, smallest finite logit
        stride_l,
        stride_c,
        stride_ip,
        stride_coef,
        stride_m,
        W,
        V,
        P,
        HAS_PEN: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_MASK: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
        p = tl.program_id(1)
        base = Logits + row * stride_l
        lo_col = p * CHUNK
        hi_col = tl.minimum(lo_col + CHUNK, V)
        offs = tl.arange(0, BLOCK)
        # penalties, then logit bias, written back in place (the order of the PyTorch path; a
        # grammar's -inf entries applied before stay -inf under both)
        if HAS_PEN:
            s = tl.load(StateRows + row)
            if s >= 0:
                f = tl.load(Coef + row)
                pr = tl.load(Coef + stride_coef + row)
                r = tl.load(Coef + 2 * stride_coef + row)
                for start in range(lo_col, hi_col, BLOCK):
                    cols = start + offs
                    mask = cols < hi_col
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
                bc = tl.load(BiasCols + j + boffs, mask=j + boffs < b1, other=0)
                bmask = (j + boffs < b1) & (bc >= lo_col) & (bc < hi_col)  # this chunk's
                bv = tl.load(BiasVals + j + boffs, mask=bmask, other=0.0)
                x = tl.load(base + bc, mask=bmask, other=0.0)
                tl.store(base + bc, x + bv, mask=bmask)
            tl.debug_barrier()
        m_vec = tl.full([BLOCK], -float("inf"), tl.float32)
        i_vec = tl.zeros([BLOCK], tl.int32)
        lo_vec = tl.full([BLOCK], float("inf"), tl.float32)
        for start in range(lo_col, hi_col, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < hi_col, other=-float("inf"))
            if HAS_MASK:  # the grammar's bitmask, last: its -inf entries stay -inf under all
                words = tl.load(Mask + row * stride_m + cols // 32, mask=cols // 32 < W, other=-1)
                x = tl.where(((words >> (cols % 32)) & 1) != 0, x, -float("inf"))
                tl.store(base + cols, x, mask=cols < hi_col)
            up = x > m_vec  # strict: a lane keeps its first maximum
            i_vec = tl.where(up, cols, i_vec)
            m_vec = tl.where(up, x, m_vec)
            lo_vec = tl.minimum(lo_vec, tl.where(x > -float("inf"), x, float("inf")))
        m = tl.max(m_vec, 0)
        first = tl.min(tl.where(m_vec == m, i_vec, V), 0)
        out = Stats + (row * P + p) * 3
        tl.store(out, m)
        tl.store(out + 1, first.to(tl.float32))
        tl.store(out + 2, tl.min(lo_vec, 0))

    @triton.jit
    def _row_params(Params, stride_p, row):
        """A row's temperature, top_p, top_k (the vocabulary size when off) and min_p."""
        return (
            tl.load(Params + row),
            tl.load(Params + stride_p + row),
            tl.load(Params + 2 * stride_p + row),
            tl.load(Params + 3 * stride_p + row),
        )

    @triton.jit
    def _row_stats(Stats, row, P, V, PB: tl.constexpr):
        """The row's maximum, its first index and its smallest finite logit, from the chunks'."""
        offs = tl.arange(0, PB)
        mask = offs < P
        at = Stats + (row * P + offs) * 3
        mx = tl.load(at, mask=mask, other=-float("inf"))
        idx = tl.load(at + 1, mask=mask, other=V * 1.0)
        lo = tl.load(at + 2, mask=mask, other=float("inf"))
        m = tl.max(mx, 0)
        return m, tl.min(tl.where(mx == m, idx, V * 1.0), 0), tl.min(lo, 0)

    @triton.jit
    def _narrow(Cut, Zs, row, P, a, b, cnt_a, cnt_b, top_k, top_p, use_k, use_p, frac,
                PB: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """One step of the cut search from the chunks' counts and masses above the NT
        thresholds that split [a, b) evenly: ok holds for a prefix of them (both predicates
        shrink as the threshold grows), a moves to the last of it, b to the first after it."""
        offs_p = tl.arange(0, PB)
        offs_t = tl.arange(0, NT)
        pmask = offs_p < P
        at = Cut + (row * P + offs_p[:, None]) * (2 * NT) + offs_t[None, :]
        count = tl.sum(tl.load(at, mask=pmask[:, None], other=0.0), 0)  # [NT]
        mass = tl.sum(tl.load(at + NT, mask=pmask[:, None], other=0.0), 0)
        z = tl.sum(tl.load(Zs + row * P + offs_p, mask=pmask, other=0.0), 0)
        mids = a + (b - a) * frac
        ok_k = tl.where(use_k, count >= top_k, False)
        ok = ok_k | tl.where(use_p, mass >= top_p * z, False)
        a_new = tl.max(tl.where(ok, mids, a), 0)
        cnt_a = tl.min(tl.where(ok, count, cnt_a), 0)
        b = tl.min(tl.where(ok, b, mids), 0)
        cnt_b = tl.max(tl.where(ok, cnt_b, count), 0)
        return a_new, b, cnt_a, cnt_b

    @triton.jit
    def _next_interval(St, Cut, Zs, row, P, top_k, top_p, use_k, use_p, frac,
                       PB: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """A row's search state after the previous round (its state ``St`` and the chunks'
        counts ``Cut``): a, b, cnt_a, cnt_b, whether to search on, and min-p's cut tau0."""
        a = tl.load(St + row * 8)
        b = tl.load(St + row * 8 + 1)
        cnt_a = tl.load(St + row * 8 + 2)
        cnt_b = tl.load(St + row * 8 + 3)
        searching = tl.load(St + row * 8 + 4) > 0.0
        if searching:
            a, b, cnt_a, cnt_b = _narrow(
                Cut, Zs, row, P, a, b, cnt_a, cnt_b, top_k, top_p, use_k, use_p, frac, PB, NT
            )
            # once [a, b) holds at most one logit, narrowing it cannot change the kept set
            # {x >= a}: the search is over
            searching = cnt_a - cnt_b > 1.0
        return a, b, cnt_a, cnt_b, searching, tl.load(St + row * 8 + 5)

    @triton.jit
    def _cut_counts(x, m, inv_t, mids, c2, s2, z_vec, FIRST: tl.constexpr):
        """One block of a search round: per-lane counts and masses above each threshold, and
        (first round) the normaliser's partial sums."""
        e = tl.exp((x - m) * inv_t)
        if FIRST:
            z_vec += e
        keep = x[None, :] >= mids[:, None]
        c2 += keep.to(tl.float32)
        s2 += tl.where(keep, e[None, :], 0.0)
        return c2, s2, z_vec

    @triton.jit(do_not_specialize=_PER_STEP)
    def _round_kernel(
        Logits,
        Params,  # [5, bs] fp32: temperature, top_p, top_k, min_p, greedy
        Stats,
        Zs,  # [bs, P] fp32: the chunks' normaliser sums (first round)
        CutIn,  # [bs, P, 2, NT] fp32: the previous round's counts and masses
        CutOut,
        StIn,  # [bs, 8] fp32: the previous round's a, b, cnt_a, cnt_b, searching, tau0
        StOut,
        stride_l,
        stride_p,
        V,
        P,
        FIRST: tl.constexpr,
        CHUNK: tl.constexpr,
        SBLOCK: tl.constexpr,
        PB: tl.constexpr,
        NT: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
        p = tl.program_id(1)
        if tl.load(Params + 4 * stride_p + row) == 0.0:  # greedy rows are done
            temp, top_p, top_k, min_p = _row_params(Params, stride_p, row)
            inv_t = 1.0 / temp
            use_k = top_k < V
            use_p = top_p < 1.0
            m, _, lo = _row_stats(Stats, row, P, V, PB)
            frac = (tl.arange(0, NT) + 1).to(tl.float32) / (NT + 1)
            if FIRST:
                tau0 = lo
                if min_p > 0.0:
                    tau0 = tl.maximum(tau0, m + temp * tl.log(min_p))
                a = tau0
                # any b above the maximum (nothing at or above it) will do; one relative to the
                # row's range keeps the rounds' resolution on rows of small range (m + 1 would
                # leave a row spanning 0.01 a fiftieth of it after 3 rounds)
                b = m + tl.maximum(tl.maximum((m - a) * 0.0625, tl.abs(m) * 1e-6), 1e-30)
                cnt_a = V * 1.0
                cnt_b = 0.0
                searching = use_k | use_p
            else:
                a, b, cnt_a, cnt_b, searching, tau0 = _next_interval(
                    StIn, CutIn, Zs, row, P, top_k, top_p, use_k, use_p, frac, PB, NT
                )
            if p == 0:
                tl.store(StOut + row * 8, a)
                tl.store(StOut + row * 8 + 1, b)
                tl.store(StOut + row * 8 + 2, cnt_a)
                tl.store(StOut + row * 8 + 3, cnt_b)
                tl.store(StOut + row * 8 + 4, tl.where(searching, 1.0, 0.0))
                tl.store(StOut + row * 8 + 5, tau0)
            if searching:
                base = Logits + row * stride_l
                lo_col = p * CHUNK
                hi_col = tl.minimum(lo_col + CHUNK, V)
                soffs = tl.arange(0, SBLOCK)
                mids = a + (b - a) * frac
                c2 = tl.zeros([NT, SBLOCK], tl.float32)
                s2 = tl.zeros([NT, SBLOCK], tl.float32)
                z_vec = tl.zeros([SBLOCK], tl.float32)
                # Four SBLOCK loads issued before any is used: more bytes in flight per
                # program (a single program per row was bound by load latency on the H200).
                for start in range(lo_col, hi_col, 4 * SBLOCK):
                    c0 = start + soffs
                    ninf = -float("inf")
                    x0 = tl.load(base + c0, mask=c0 < hi_col, other=ninf)
                    x1 = tl.load(base + c0 + SBLOCK, mask=c0 + SBLOCK < hi_col, other=ninf)
                    x2 = tl.load(base + c0 + 2 * SBLOCK, mask=c0 + 2 * SBLOCK < hi_col, other=ninf)
                    x3 = tl.load(base + c0 + 3 * SBLOCK, mask=c0 + 3 * SBLOCK < hi_col, other=ninf)
                    c2, s2, z_vec = _cut_counts(x0, m, inv_t, mids, c2, s2, z_vec, FIRST)
                    c2, s2, z_vec = _cut_counts(x1, m, inv_t, mids, c2, s2, z_vec, FIRST)
                    c2, s2, z_vec = _cut_counts(x2, m, inv_t, mids, c2, s2, z_vec, FIRST)
                    c2, s2, z_vec = _cut_counts(x3, m, inv_t, mids, c2, s2, z_vec, FIRST)
                offs_t = tl.arange(0, NT)
                at = CutOut + (row * P + p) * (2 * NT)
                tl.store(at + offs_t, tl.sum(c2, 1))
                tl.store(at + NT + offs_t, tl.sum(s2, 1))
                if FIRST:
                    tl.store(Zs + row * P + p, tl.sum(z_vec, 0))

    @triton.jit
    def _gumbel(seed, start, stream, BLOCK: tl.constexpr):
        """Gumbel noise for columns ``start .. start + BLOCK`` (``start`` a multiple of 4) of one
        noise ``stream``: column ``c``'s is the ``c % 4``-th of the four outputs of Philox
        counter ``(c // 4, stream)``, so it does not depend on the chunking, and one Philox
        evaluation serves four columns (it is the draw's main cost)."""
        q = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.int64) + stream * 4294967296
        u0, u1, u2, u3 = tl.rand4x(seed, q)
        # join(join(u0, u2), join(u1, u3))[n, i, j] is output 2 j + i: flat index 4 n + 2 i + j
        u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [BLOCK])
        return -tl.log(-tl.log(u))

    @triton.jit(do_not_specialize=_PER_STEP)
    def _draw_kernel(
        Logits,
        Params,
        Seeds,  # [bs] int64, when HAS_SEEDS
        Stats,
        Zs,
        Cut,  # the last round's counts and masses
        St,  # the last round's state
        Draw,  # [bs, P, 4] fp32: the chunk's best Gumbel score, its index, and the smallest and
        # largest of its logits inside the open interval [tau, b) (when SEARCH)
        Fin,  # [bs, 4] fp32: the draw's cut, the search's upper bound b, whether it was open
        stride_l,
        stride_p,
        base_seed,
        V,
        P,
        HAS_SEEDS: tl.constexpr,
        SEARCH: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        PB: tl.constexpr,
        NT: tl.constexpr,
    ):
        """The Gumbel-max draw over {x >= tau} in one chunk, after the last round's step
        (``SEARCH=False``: no row has top-k or top-p, no rounds ran, tau is min-p's cut)."""
        row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
        p = tl.program_id(1)
        if tl.load(Params + 4 * stride_p + row) == 0.0:
            temp, top_p, top_k, min_p = _row_params(Params, stride_p, row)
            inv_t = 1.0 / temp
            m, _, lo = _row_stats(Stats, row, P, V, PB)
            if SEARCH:
                frac = (tl.arange(0, NT) + 1).to(tl.float32) / (NT + 1)
                a, b, _, _, searching, tau0 = _next_interval(
                    St, Cut, Zs, row, P, top_k, top_p, top_k < V, top_p < 1.0, frac, PB, NT
                )
                tau = tl.maximum(tau0, a)
                if p == 0:  # for the pick's exact check of a draw from [a, b)
                    tl.store(Fin + row * 4, tau)
                    tl.store(Fin + row * 4 + 1, b)
                    tl.store(Fin + row * 4 + 2, tl.where(searching, 1.0, 0.0))
            else:  # as the first round sets it up
                tau = lo
                if min_p > 0.0:
                    tau = tl.maximum(tau, m + temp * tl.log(min_p))
                b = tau
            if HAS_SEEDS:
                seed = tl.load(Seeds + row)
            else:
                seed = base_seed + row
            base = Logits + row * stride_l
            lo_col = p * CHUNK
            hi_col = tl.minimum(lo_col + CHUNK, V)
            offs = tl.arange(0, BLOCK)
            t_vec = tl.full([BLOCK], -float("inf"), tl.float32)
            j_vec = tl.zeros([BLOCK], tl.int32)
            in_lo = tl.full([BLOCK], float("inf"), tl.float32)
            in_hi = tl.full([BLOCK], -float("inf"), tl.float32)
            for start in range(lo_col, hi_col, BLOCK):
                cols = start + offs
                x = tl.load(base + cols, mask=cols < hi_col, other=-float("inf"))
                g = _gumbel(seed, start, 0, BLOCK)
                score = tl.where(x >= tau, (x - m) * inv_t + g, -float("inf"))
                up = score > t_vec
                j_vec = tl.where(up, cols, j_vec)
                t_vec = tl.where(up, score, t_vec)
                if SEARCH:
                    inside = (x >= tau) & (x < b)
                    in_lo = tl.minimum(in_lo, tl.where(inside, x, float("inf")))
                    in_hi = tl.maximum(in_hi, tl.where(inside, x, -float("inf")))
            top = tl.max(t_vec, 0)
            best = tl.min(tl.where(t_vec == top, j_vec, V), 0)
            at = Draw + (row * P + p) * 4
            tl.store(at, top)
            tl.store(at + 1, best.to(tl.float32))
            tl.store(at + 2, tl.min(in_lo, 0))
            tl.store(at + 3, tl.max(in_hi, 0))

    @triton.jit(do_not_specialize=_PER_STEP)
    def _pick_kernel(
        Logits,
        Params,
        Seeds,
        Stats,
        Zs,
        Draw,
        Fin,
        Out,
        StateRows,
        Counts,
        stride_l,
        stride_p,
        stride_c,
        base_seed,
        V,
        P,
        HAS_PEN: tl.constexpr,
        HAS_SEEDS: tl.constexpr,
        SEARCH: tl.constexpr,
        PB: tl.constexpr,
        FB: tl.constexpr,
    ):
        """Each row's token (greedy: the first maximum; else the chunks' best draw), and its
        count in the penalty state. A draw that fell inside a search interval ``[a, b)`` the
        rounds left open (more than one logit in it) is checked exactly and, if outside the
        kept set, redrawn (see ``_settle``)."""
        row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
        if tl.load(Params + 4 * stride_p + row) != 0.0:
            _, best, _ = _row_stats(Stats, row, P, V, PB)
            token = best.to(tl.int64)
        else:
            offs = tl.arange(0, PB)
            mask = offs < P
            at = Draw + (row * P + offs) * 4
            score = tl.load(at, mask=mask, other=-float("inf"))
            idx = tl.load(at + 1, mask=mask, other=V * 1.0)
            top = tl.max(score, 0)
            token = tl.min(tl.where(score == top, idx, V * 1.0), 0).to(tl.int64)
            if SEARCH:
                # An open interval holding a single value (ties, as bf16 logits often are at a
                # top-k cut) is kept whole: the logits above it fail the cut's predicate (b does)
                # and those from it on satisfy it (a does), so the cut is that value and a draw
                # of it needs no check.
                in_lo = tl.min(tl.load(at + 2, mask=mask, other=float("inf")), 0)
                in_hi = tl.max(tl.load(at + 3, mask=mask, other=-float("inf")), 0)
                if (tl.load(Fin + row * 4 + 2) > 0.0) & (in_hi > in_lo):
                    token = _settle(Logits, Params, Seeds, Stats, Zs, Fin, stride_l, stride_p,
                                    base_seed, V, P, row, token, HAS_SEEDS, PB, FB)  # fmt: skip
        tl.store(Out + row, token)
        if HAS_PEN:
            s = tl.load(StateRows + row)
            if s >= 0:  # count the token drawn (one state row per batch row)
                tl.atomic_add(Counts + s * stride_c + token, 1)

    @triton.jit
    def _settle(Logits, Params, Seeds, Stats, Zs, Fin, stride_l, stride_p, base_seed, V, P,
                row, token, HAS_SEEDS: tl.constexpr, PB: tl.constexpr, FB: tl.constexpr):  # fmt: skip
        """The rounds narrowed the cut to ``[a, b)`` and the draw ran over ``{x >= a}``, a superset
        of the kept set ``{x >= cut}``. A token at or above ``b`` is kept. One below ``b`` is
        kept exactly when the logits above it hold fewer than top-k and less than top-p of the
        mass (the cut's definition, evaluated at it); if it is not kept, every kept logit lies
        above it, and the draw is repeated over the logits above it with fresh noise. This is
        rejection sampling from a superset, so the result follows the filtered softmax
        exactly; the loop ends because the candidate set shrinks every time. It runs only for
        rows whose search interval still holds several logits after the rounds, and draws into
        it are rare (a few logits of a wide range); one program walks the row."""
        base = Logits + row * stride_l
        tau = tl.load(Fin + row * 4)
        b = tl.load(Fin + row * 4 + 1)
        xw = tl.load(base + token)
        pending = xw < b
        if pending:
            temp, top_p, top_k, _ = _row_params(Params, stride_p, row)
            inv_t = 1.0 / temp
            use_k = top_k < V
            use_p = top_p < 1.0
            m, _, _ = _row_stats(Stats, row, P, V, PB)
            offs_p = tl.arange(0, PB)
            z = tl.sum(tl.load(Zs + row * P + offs_p, mask=offs_p < P, other=0.0), 0)
            if HAS_SEEDS:
                seed = tl.load(Seeds + row)
            else:
                seed = base_seed + row
            offs = tl.arange(0, FB)
            stream = row * 0  # the noise stream of the redraw (the first draw's is 0)
            while pending:
                cnt = tl.zeros([FB], tl.float32)
                mass = tl.zeros([FB], tl.float32)
                for start in range(0, V, FB):
                    cols = start + offs
                    x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                    above = x > xw
                    cnt += above.to(tl.float32)
                    mass += tl.where(above, tl.exp((x - m) * inv_t), 0.0)
                out_k = use_k & (tl.sum(cnt, 0) >= top_k)
                out_p = use_p & (tl.sum(mass, 0) >= top_p * z)
                pending = out_k | out_p
                if pending:  # not kept: draw again above it
                    stream += 1
                    t_vec = tl.full([FB], -float("inf"), tl.float32)
                    j_vec = tl.zeros([FB], tl.int64)
                    for start in range(0, V, FB):
                        cols = start + offs
                        x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
                        g = _gumbel(seed, start, stream, FB)
                        keep = (x > xw) & (x >= tau)
                        score = tl.where(keep, (x - m) * inv_t + g, -float("inf"))
                        up = score > t_vec
                        j_vec = tl.where(up, cols.to(tl.int64), j_vec)
                        t_vec = tl.where(up, score, t_vec)
                    top = tl.max(t_vec, 0)
                    token = tl.min(tl.where(t_vec == top, j_vec, V), 0)
                    xw = tl.load(base + token)
                    pending = xw < b
        return token


def _random_seed() -> int:
    """A random base seed of 62 bits whose top bit is set: Triton types an int argument by its
    value, and a seed below 2**31 would be 32-bit, another compiled variant."""
    return random.getrandbits(62) | (1 << 61)


def enabled(logits: torch.Tensor) -> bool:
    """The fused kernel serves CUDA logits (CPU tests call :func:`fused_sample` directly under
    ``TRITON_INTERPRET=1``)."""
    return HAS_TRITON and logits.is_cuda


_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


def row_seed(seed: int, position: int) -> int:
    """A seeded row's Philox seed for one output position (as the PyTorch path's generator)."""
    return (seed * 1_000_003 + position) & _SEED_MASK


@dataclass
class FusedPenalties:
    """What the kernel needs to apply penalties and logit bias itself (``fused_sample``), built
    once per batch (``BatchSampler``'s plan). The counts live in a ``PenaltyState``,
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
    iters: int = 3,
    extras: FusedPenalties | None = None,
    state=None,
    vocab_mask: torch.Tensor | None = None,
    greedy_only: bool = False,
    search: bool = True,
    row_seeds: torch.Tensor | None = None,
    thresholds: int = _THRESHOLDS,
) -> torch.Tensor:
    """Token ids ``[bs]`` for fp32 ``logits [bs, vocab]`` (row stride may exceed the width).
    ``params`` is ``[5, bs]`` fp32 on the device: temperature, top_p, top_k (the vocabulary
    size when off), min_p, greedy (1.0 / 0.0). ``seeds``: ``(row, seed, output position)`` of
    seeded rows; the others draw from ``base_seed`` (random when None) plus the row index.
    ``iters``: rounds of the top-k / top-p cut search, each narrowing the logit range
    ``thresholds + 1`` times (3 rounds of 16: 4,913 times). The search need not close: a draw
    that lands in the interval still open is checked exactly and redrawn if outside the kept
    set (``_settle``), so fewer rounds trade launches (~12 us of device time each at batch 32
    on the H200) for that rare check. More thresholds a round cost more than they save
    (64 x 4 took 172 us against 99 us for 16 x 6, bench/sampling_host.py).
    ``extras``: penalties (with ``state``, the ``PenaltyState`` holding the counts, which the
    kernel also advances by the drawn token) and logit bias, applied to ``logits`` in place
    first, in the kernel that starts the draw. ``vocab_mask``: a grammar bitmask on the device
    (``[bs, words]`` int32, 32 tokens a word, bit set = allowed; the grammar family's format),
    applied in place there too, after them. ``greedy_only`` (every row greedy) launches only
    the prep and pick kernels; ``search=False`` (no row has top-k or top-p) skips the rounds.
    Both are the caller's promise about ``params``, which stay on the device. ``row_seeds``:
    every row's Philox seed as an int64 device tensor (instead of ``seeds`` / ``base_seed``; see
    ``per_row_seeds``)."""
    bs, vocab = logits.shape
    out = torch.empty(bs, dtype=torch.int64, device=logits.device)
    if bs == 0:
        return out
    if base_seed is None:
        base_seed = _random_seed()
    seed_t = out  # unused unless seeded
    if row_seeds is not None:
        seed_t = row_seeds
    elif seeds:
        per_row = per_row_seeds(bs, seeds, base_seed)
        seed_t = torch.tensor(per_row, dtype=torch.int64).to(logits.device, non_blocking=True)
    block = max(4, min(_CHUNK, triton.next_power_of_2(vocab)))  # a chunk: one program's columns
    chunks = triton.cdiv(vocab, block)
    pb = triton.next_power_of_2(chunks)
    nt = thresholds
    assert nt >= 2 and nt & (nt - 1) == 0, "thresholds: a power of two"
    # a round's [nt, sblock] accumulators hold 2 * block entries whatever nt is (16: two
    # iterations of four 512-wide loads per 4,096-column chunk)
    sblock = max(1, block * 2 // nt)
    has_pen = extras is not None and extras.state_rows is not None
    has_bias = extras is not None and extras.bias_ptr is not None
    counts = state.counts if has_pen else out
    in_prompt = state.in_prompt.view(torch.int8) if has_pen else out
    coef = extras.coef if has_pen else params
    state_rows = extras.state_rows if has_pen else out
    stats, zs, cut, st, draw, fin = _workspace(
        logits.device, (bs, chunks, 3), (bs, chunks), (2, bs, chunks, 2, nt), (2, bs, 8),
        (bs, chunks, 4), (bs, 4),
    )  # fmt: skip
    grid = (bs, chunks)
    _prep_kernel[grid](
        logits,
        state_rows,
        counts,
        in_prompt,
        coef,
        extras.bias_ptr if has_bias else out,
        extras.bias_cols if has_bias else out,
        extras.bias_vals if has_bias else params,
        vocab_mask if vocab_mask is not None else out,
        stats,
        logits.stride(0),
        counts.stride(0),
        in_prompt.stride(0),
        coef.stride(0),
        vocab_mask.stride(0) if vocab_mask is not None else 0,
        vocab_mask.shape[1] if vocab_mask is not None else 0,
        vocab,
        chunks,
        HAS_PEN=has_pen,
        HAS_BIAS=has_bias,
        HAS_MASK=vocab_mask is not None,
        CHUNK=block,
        BLOCK=block,
        num_warps=8,
    )
    # (the first round sets each row's interval up: at least one when searching)
    iters = 0 if greedy_only or not search else max(1, iters)
    for r in range(iters):
        _round_kernel[grid](
            logits,
            params,
            stats,
            zs,
            cut[(r - 1) % 2],
            cut[r % 2],
            st[(r - 1) % 2],
            st[r % 2],
            logits.stride(0),
            params.stride(0),
            vocab,
            chunks,
            FIRST=r == 0,
            CHUNK=block,
            SBLOCK=sblock,
            PB=pb,
            NT=nt,
            num_warps=8,
        )
    last = (iters - 1) % 2
    seeded = bool(seeds) or row_seeds is not None
    pick = (logits, params, seed_t, stats, zs, draw, fin, out, state_rows, counts, base_seed)
    if greedy_only:
        return _pick(*pick, has_pen, seeded, False, pb)
    _draw_kernel[grid](
        logits,
        params,
        seed_t,
        stats,
        zs,
        cut[last],
        st[last],
        draw,
        fin,
        logits.stride(0),
        params.stride(0),
        base_seed,
        vocab,
        chunks,
        HAS_SEEDS=seeded,
        SEARCH=iters > 0,
        CHUNK=block,
        BLOCK=block,
        PB=pb,
        NT=nt,
        num_warps=8,
    )
    return _pick(*pick, has_pen, seeded, iters > 0, pb)


def _pick(logits, params, seed_t, stats, zs, draw, fin, out, state_rows, counts, base_seed,
          has_pen, seeded, search, pb):  # fmt: skip
    bs, vocab = logits.shape
    _pick_kernel[(bs,)](
        logits,
        params,
        seed_t,
        stats,
        zs,
        draw,
        fin,
        out,
        state_rows,
        counts,
        logits.stride(0),
        params.stride(0),
        counts.stride(0),
        base_seed,
        vocab,
        stats.shape[1],
        HAS_PEN=has_pen,
        HAS_SEEDS=seeded,
        SEARCH=search,
        PB=pb,
        FB=max(4, min(1024, triton.next_power_of_2(vocab))),
    )
    return out


def per_row_seeds(
    bs: int, seeds: list[tuple[int, int, int]] | None, base: int | None = None
) -> list[int]:
    """Every row's Philox seed for one step: a seeded row's ``row_seed(seed, position)``,
    other rows ``base`` (random when None) plus 2**32 per row. A caller that keeps these on the
    device and adds one per step (``fused_sample(row_seeds=...)``) follows a seeded row's
    positions exactly as the eager path does and keeps the other rows' streams apart."""
    base = _random_seed() if base is None else base
    out = [(base + (r << 32)) & _SEED_MASK for r in range(bs)]
    for row, seed, position in seeds or ():
        out[row] = row_seed(seed, position)
    return out


def _workspace(device: torch.device, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """fp32 scratch tensors of these shapes carved from one allocation (one call into the
    caching allocator a step instead of one per tensor), each starting on a 16-byte boundary
    so the kernels' pointer specialisations stay the same for every batch size."""
    sizes = [(math.prod(s) + 3) // 4 * 4 for s in shapes]
    buf = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    out, at = [], 0
    for shape, n in zip(shapes, sizes, strict=True):
        out.append(buf[at : at + math.prod(shape)].view(shape))
        at += n
    return out
