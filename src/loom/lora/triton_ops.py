"""Triton kernels for multi-LoRA: every adapter of a batch in one launch per step of a packed
projection (one shrink, one expand), with no host synchronisation, so a decode step can be
captured in a CUDA graph.

Pool layout (``LoRAManager.buffers[layer][packed]``), for a packed projection of ``S`` slices
(3 for qkv, 2 for gate_up, 1 otherwise) and pool rank ``r``:

- ``a_buf [slots, S*r, in]``: rows ``j*r : (j+1)*r`` are slice ``j``'s A.
- ``b_buf [slots, out, S*r]``: block-diagonal; output rows of slice ``j`` (``offsets[j] :
  offsets[j+1]``) hold their B (scaling folded in by ``adapter.py``) in columns ``j*r :
  (j+1)*r``, zeros elsewhere. The kernels never read the off-diagonal blocks.
- An adapter of rank ``k < r`` is zero-padded (A rows and B columns ``k..r`` of each slice), so
  the kernels are right with no per-slot rank; ``slot_ranks [slots]`` (int32, device), when
  given, masks the padding so it is not read. It must be at least every module's rank of the
  slot's adapter (the adapter's ``rank``).

Per token ``t`` with slot ``s = token_slot[t]`` (``-1``: no adapter, ``y[t]`` untouched)::

    v[t, j*r:(j+1)*r] = A_s[j*r:(j+1)*r] @ x[t]                         (shrink)
    y[t, offsets[j]:offsets[j+1]] += B_s[offsets[j]:offsets[j+1], j*r:(j+1)*r] @ v[t, j*r:(j+1)*r]

Two kernel pairs:

- gather (decode): one program per token x slice (x split of ``in``) for the shrink and per
  token x block of output rows for the expand; each program reads its token's slot from
  ``token_slot``, so the grid depends only on the shapes and ``token_slot`` can be a graph's
  static input buffer. Tokens sharing a slot each re-read that slot's A and B (from L2).
- segment (prefill, SGMV-style): the batch's tokens as runs of one slot (``seg_start``,
  ``seg_len``, ``seg_slot``, device int32: ``batch.py``'s ``Segments``); a program takes a tile
  of ``BLOCK_T`` tokens of one run and multiplies with ``tl.dot``, so a slot's weights are read
  once per token tile. Its grid is ``(segments, cdiv(max_seg_len, BLOCK_T), ...)``: the host
  must know the segments, which suits eager prefill/extend batches, not captured graphs.

Off CUDA (Triton's interpreter) the dots run in fp32: the interpreter's bf16 ``tl.dot`` returns
garbage (Triton 3.9).

The shrink writes fp32 partial sums ``[splits, T, S*r]`` (``in`` divided among ``splits``
programs so one decode token fills the GPU); the expand adds the splits as it reads them, so no
reduction kernel or atomics are needed and the result is deterministic.

``lora_shrink_expand`` picks the segment kernels when the batch has segments and its tokens
average at least ``SEGMENT_MIN_RUN`` (4) per segment, the gather kernels otherwise (one token
per slot run, as in decode, or no segments, as under a graph). Measured on an H200
(bench/lora_kernels.py --graph: Llama-3-8B shapes, rank 16, bf16, base matmul included, us):
runs of 1 token favour gather (qkv, 64 tokens on 64 slots: 39 against 44), runs of 4 and more
the segments (qkv, 256 tokens on 64 slots: 51 against 61; 64 tokens on one slot: 26 against
32). Today's torch loop took 933 and 1149 us for those two (one slot: 29). Eager, each Triton
launch costs about 40 us of host time, so a host-bound eager step with one adapter is faster
on the torch path (qkv, 64 tokens: 73 against 100 us).

Slice offsets are kernel scalars (fixed per projection), not a device tensor. The oracle is
``lora_reference`` in tests/test_lora_triton.py (on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from loom.lora.batch import LoRABatch, Segments

HAS_TRITON = importlib.util.find_spec("triton") is not None

MAX_SLICES = 4  # slice offsets travel as the kernel scalars O1..O3
SEGMENT_MIN_RUN = 4  # lora_shrink_expand: segment kernels at this many tokens per segment
MAX_SPLITS = 16  # most programs a segment's token tile divides ``in`` among
GATHER_MAX_SPLITS = 64  # most programs one token's shrink divides ``in`` among
# Partial sums the gather expand loads at once (unrolled). Measured on the H200
# (bench/lora_kernels.py --graph, Llama-3-8B shapes, us): at 1 token, down_proj's update costs
# 8.1 over the base matmul with up to 64 splits loaded this way, 10.6 with 16 loaded one at a
# time; at 64 tokens (2-5 splits) unrolled loads and loads one at a time time the same.
SPLIT_CHUNK = 8

# The split count and the partial sums' stride vary with the batch: specialised on (a value
# of one, or a multiple of 16) they would compile new variants for batch shapes the start-up
# warm-up never ran, inside a first request's prefill (0.2-0.6 s a kernel on the H200).
if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _slice_of(rows, O1, O2, O3):
        """Index of the slice each output row lies in (offsets O1 <= O2 <= O3; unused ones are
        ``out``, which no valid row reaches)."""
        return (rows >= O1).to(tl.int32) + (rows >= O2).to(tl.int32) + (rows >= O3).to(tl.int32)

    @triton.jit
    def _expand_rows(
        nb, slot, Rank, N, R, O1, O2, O3,
        HAS_RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """An expand program's output rows (block ``nb`` of ``BLOCK_N``, ``nb * BLOCK_N < N``)
        and rank columns for ``slot`` (not -1): ``rows``, ``row_ok`` (``rows < N``), each row's
        slice, ``j_lo <= j_hi`` the slices of the block's first and last valid rows, the
        columns ``c`` of one slice and ``c_ok``, those below the slot's rank (below ``R``
        without ``HAS_RANK``)."""
        r0 = nb * BLOCK_N
        rows = r0 + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        row_slice = _slice_of(rows, O1, O2, O3)
        j_lo = _slice_of(r0, O1, O2, O3)
        j_hi = _slice_of(tl.minimum(r0 + BLOCK_N, N) - 1, O1, O2, O3)
        c = tl.arange(0, BLOCK_R)
        if HAS_RANK:
            c_ok = c < tl.minimum(tl.load(Rank + slot), R)
        else:
            c_ok = c < R
        return rows, row_ok, row_slice, j_lo, j_hi, c, c_ok

    @triton.jit(do_not_specialize=("K_PER_SPLIT", "stride_vs"))
    def _shrink_gather_kernel(
        X, A, Slot, Rank, V, K, R, K_PER_SPLIT,
        stride_xt, stride_as, stride_ar, stride_vs, stride_vt,
        HAS_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # program (token t, slice s, split sp): V[sp, t, s*R + c] = A[slot, s*R + c, ks] @ x[t, ks]
        # over ks in [sp*K_PER_SPLIT, (sp+1)*K_PER_SPLIT) (a multiple of BLOCK_K).
        t = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(Slot + t).to(tl.int64)
        c = tl.arange(0, BLOCK_R)
        out = V + sp * stride_vs + t * stride_vt + s * R + c
        if slot < 0:
            tl.store(out, tl.zeros([BLOCK_R], dtype=tl.float32), mask=c < R)
        else:
            if HAS_RANK:
                c_ok = c < tl.minimum(tl.load(Rank + slot), R)
            else:
                c_ok = c < R
            a_rows = A + slot * stride_as + (s * R + c)[:, None] * stride_ar
            acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
            k_lo = sp * K_PER_SPLIT
            for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(X + t * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)
                a = tl.load(a_rows + ks[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
                acc += a.to(tl.float32) * x[None, :]
            tl.store(out, tl.sum(acc, axis=1), mask=c < R)

    @triton.jit(do_not_specialize=("NSPLIT", "stride_vs"))
    def _expand_gather_kernel(
        V, B, Slot, Rank, Y, N, R, NSPLIT, O1, O2, O3,
        stride_vs, stride_vt, stride_bs, stride_bn, stride_yt,
        HAS_RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        SPLIT_CHUNK: tl.constexpr,
    ):  # fmt: skip
        # program (token t, rows block nb): for each slice j the block's rows touch,
        # y[t, rows of j] += B[slot, rows of j, j*R + c] . v[t, j*R + c]: every row reads its own
        # slice's R columns only, and v (summed over the splits) once per slice. The splits are
        # read SPLIT_CHUNK at a time by unrolled loads, so a one-token step (up to
        # GATHER_MAX_SPLITS splits) does not wait on one load after another.
        t = tl.program_id(0).to(tl.int64)
        nb = tl.program_id(1)
        slot = tl.load(Slot + t).to(tl.int64)
        if slot >= 0:
            rows, row_ok, row_slice, j_lo, j_hi, c, c_ok = _expand_rows(
                nb, slot, Rank, N, R, O1, O2, O3, HAS_RANK, BLOCK_N, BLOCK_R
            )
            b_rows = B + slot * stride_bs + rows[:, None] * stride_bn
            d = tl.zeros([BLOCK_N], dtype=tl.float32)
            for j in range(j_lo, j_hi + 1):
                cols = j * R + c
                v = tl.zeros([BLOCK_R], dtype=tl.float32)
                for sp0 in range(0, NSPLIT, SPLIT_CHUNK):
                    for u in tl.static_range(SPLIT_CHUNK):
                        v += tl.load(
                            V + (sp0 + u) * stride_vs + t * stride_vt + cols,
                            mask=c_ok & (c * 0 + sp0 + u < NSPLIT),
                            other=0.0,
                        )
                m = (row_ok & (row_slice == j))[:, None] & c_ok[None, :]
                b = tl.load(b_rows + cols[None, :], mask=m, other=0.0)
                d += tl.sum(b.to(tl.float32) * v[None, :], axis=1)
            yp = Y + t * stride_yt + rows
            y = tl.load(yp, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(yp, (y + d).to(Y.dtype.element_ty), mask=row_ok)

    @triton.jit(do_not_specialize=("K_PER_SPLIT", "NSPLIT", "stride_vs"))
    def _shrink_segment_kernel(
        X, A, SegStart, SegLen, SegSlot, Rank, V, K, R, K_PER_SPLIT, NSPLIT,
        stride_xt, stride_as, stride_ar, stride_vs, stride_vt,
        HAS_RANK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # program (segment g, token tile tb, slice s x split sp): V[sp, toks, s*R + c] =
        # x[toks, ks] @ A[slot, s*R + c, ks]^T, toks = the tile's tokens of segment g.
        g = tl.program_id(0)
        tb = tl.program_id(1)
        s = tl.program_id(2) // NSPLIT
        sp = tl.program_id(2) % NSPLIT
        n = tl.load(SegLen + g)
        slot = tl.load(SegSlot + g).to(tl.int64)
        if (tb * BLOCK_T < n) & (slot >= 0):
            offs = tb * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = offs < n
            toks = tl.load(SegStart + g).to(tl.int64) + offs
            c = tl.arange(0, BLOCK_R)
            if HAS_RANK:
                c_ok = c < tl.minimum(tl.load(Rank + slot), R)
            else:
                c_ok = c < R
            a_cols = A + slot * stride_as + (s * R + c)[None, :] * stride_ar  # A^T: [K, BLOCK_R]
            acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
            k_lo = sp * K_PER_SPLIT
            for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                x = tl.load(
                    X + toks[:, None] * stride_xt + ks[None, :],
                    mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                a = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
                if DOT_F32:
                    acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, a.to(x.dtype), acc, input_precision=PRECISION)
            tl.store(
                V + sp * stride_vs + toks[:, None] * stride_vt + (s * R + c)[None, :],
                acc,
                mask=t_ok[:, None] & (c < R)[None, :],
            )

    @triton.jit(do_not_specialize=("NSPLIT", "stride_vs"))
    def _expand_segment_kernel(
        V, B, SegStart, SegLen, SegSlot, Rank, Y, N, R, NSPLIT, O1, O2, O3,
        stride_vs, stride_vt, stride_bs, stride_bn, stride_yt,
        HAS_RANK: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        # program (segment g, token tile tb, rows block nb): for each slice j the block's rows
        # touch, y[toks, rows of j] += v[toks, j*R + c] @ B[slot, rows of j, j*R + c]^T.
        g = tl.program_id(0)
        tb = tl.program_id(1)
        nb = tl.program_id(2)
        n = tl.load(SegLen + g)
        slot = tl.load(SegSlot + g).to(tl.int64)
        if (tb * BLOCK_T < n) & (slot >= 0):
            offs = tb * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = offs < n
            toks = tl.load(SegStart + g).to(tl.int64) + offs
            rows, row_ok, row_slice, j_lo, j_hi, c, c_ok = _expand_rows(
                nb, slot, Rank, N, R, O1, O2, O3, HAS_RANK, BLOCK_N, BLOCK_R
            )
            b_rows = B + slot * stride_bs + rows[None, :] * stride_bn  # B^T: [BLOCK_R, BLOCK_N]
            acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for j in range(j_lo, j_hi + 1):
                cols = j * R + c
                v = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
                for sp in range(0, NSPLIT):
                    v += tl.load(
                        V + sp * stride_vs + toks[:, None] * stride_vt + cols[None, :],
                        mask=t_ok[:, None] & c_ok[None, :],
                        other=0.0,
                    )
                b = tl.load(
                    b_rows + cols[:, None],
                    mask=c_ok[:, None] & (row_ok & (row_slice == j))[None, :],
                    other=0.0,
                )
                if DOT_F32:
                    acc = tl.dot(v, b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(v.to(b.dtype), b, acc, input_precision=PRECISION)
            yp = Y + toks[:, None] * stride_yt + rows[None, :]
            m = t_ok[:, None] & row_ok[None, :]
            y = tl.load(yp, mask=m, other=0.0).to(tl.float32)
            tl.store(yp, (y + acc).to(Y.dtype.element_ty), mask=m)


# ---- launchers ------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _num_splits(
    programs: int, k: int, block_k: int, device: torch.device, cap: int = MAX_SPLITS
) -> int:
    """How many programs share one ``in`` reduction: enough that about two programs per SM run
    (one on CPU), at most one per ``block_k`` chunk and at most ``cap`` (the expand reads
    every split)."""
    want = triton.cdiv(2 * _sm_count(device), max(programs, 1))
    return max(1, min(want, triton.cdiv(k, block_k), cap))


def _block_t(max_len: int) -> int:
    """Token tile of the segment kernels: 16..64, no larger than the longest run needs."""
    return min(64, max(16, triton.next_power_of_2(max(max_len, 1))))


def _offsets_args(offsets: Sequence[int], out: int) -> tuple[int, int, int]:
    offs = [int(o) for o in offsets]
    if not offs or offs[0] != 0 or len(offs) > MAX_SLICES:
        raise ValueError(f"slice offsets must start at 0 and number 1..{MAX_SLICES}: {offs}")
    if any(b < a for a, b in zip(offs, offs[1:], strict=False)) or offs[-1] > out:
        raise ValueError(f"slice offsets {offs} must ascend within {out} output rows")
    rest = offs[1:] + [out] * (MAX_SLICES - len(offs))
    return rest[0], rest[1], rest[2]


def _offsets_of(slice_sizes: Sequence[int]) -> tuple[int, ...]:
    offs, at = [], 0
    for size in slice_sizes:
        offs.append(at)
        at += int(size)
    return tuple(offs)


def _check_pool(a_buf: torch.Tensor | None, b_buf: torch.Tensor | None, num_slices: int) -> int:
    buf = a_buf if a_buf is not None else b_buf
    k = buf.shape[1] if a_buf is not None else buf.shape[2]
    if k % num_slices:
        raise ValueError(f"pool width {k} is not a multiple of {num_slices} slices")
    for t in (a_buf, b_buf):
        if t is not None and (t.dim() != 3 or t.stride(2) != 1):
            raise ValueError("LoRA pool buffers must be [slots, rows, cols] with unit col stride")
    if a_buf is not None and b_buf is not None and b_buf.shape[2] != a_buf.shape[1]:
        raise ValueError(f"A is {tuple(a_buf.shape)} but B is {tuple(b_buf.shape)}")
    return k // num_slices


def _shrink_partials(
    x: torch.Tensor,
    a_buf: torch.Tensor,
    token_slot: torch.Tensor,
    num_slices: int,
    segments: Segments | None,
    slot_ranks: torch.Tensor | None,
    num_splits: int | None,
    block_k: int | None,
) -> torch.Tensor:
    """fp32 partial sums ``[splits, T, S*r]`` of ``A_slot x`` (see the module docstring)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be [T, in] with unit column stride")
    t_count, k = x.shape
    if a_buf.shape[2] != k:
        raise ValueError(f"x has {k} features, the A pool {a_buf.shape[2]}")
    r = _check_pool(a_buf, None, num_slices)
    has_rank = slot_ranks is not None
    rank_arg = slot_ranks if has_rank else token_slot
    if segments is None:
        block_r = triton.next_power_of_2(r)
        bk = block_k or min(256, triton.next_power_of_2(k))
        splits = num_splits or _num_splits(t_count * num_slices, k, bk, x.device, GATHER_MAX_SPLITS)
        k_per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
        v = torch.empty(splits, t_count, num_slices * r, device=x.device, dtype=torch.float32)
        if t_count:
            _shrink_gather_kernel[(t_count, num_slices, splits)](
                x, a_buf, token_slot, rank_arg, v, k, r, k_per,
                x.stride(0), a_buf.stride(0), a_buf.stride(1), v.stride(0), v.stride(1),
                HAS_RANK=has_rank, BLOCK_R=block_r, BLOCK_K=bk, num_warps=4,
            )  # fmt: skip
        return v
    if x.dtype != a_buf.dtype:
        raise ValueError(f"x is {x.dtype}, the A pool {a_buf.dtype}")
    block_t, block_r = _block_t(segments.max_len), max(16, triton.next_power_of_2(r))
    bk = block_k or min(64, max(16, triton.next_power_of_2(k)))
    g = segments.start.shape[0]
    tiles = triton.cdiv(segments.max_len, block_t)
    splits = num_splits or _num_splits(g * tiles * num_slices, k, bk, x.device)
    k_per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    # tokens outside every segment are never written: zeros keep lora_shrink's contract
    v = torch.zeros(splits, t_count, num_slices * r, device=x.device, dtype=torch.float32)
    if g and tiles:
        _shrink_segment_kernel[(g, tiles, num_slices * splits)](
            x, a_buf, segments.start, segments.length, segments.slot, rank_arg, v, k, r, k_per,
            splits, x.stride(0), a_buf.stride(0), a_buf.stride(1), v.stride(0), v.stride(1),
            HAS_RANK=has_rank, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            DOT_F32=not x.is_cuda, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=bk, num_warps=4,
        )  # fmt: skip
    return v


def _expand_partials(
    v: torch.Tensor,
    b_buf: torch.Tensor,
    token_slot: torch.Tensor,
    slice_offsets: Sequence[int],
    y: torch.Tensor,
    segments: Segments | None,
    slot_ranks: torch.Tensor | None,
    block_n: int | None,
) -> torch.Tensor:
    if y.dim() != 2 or y.stride(1) != 1:
        raise ValueError("y must be [T, out] with unit column stride")
    t_count, n = y.shape
    if b_buf.shape[1] != n:
        raise ValueError(f"y has {n} outputs, the B pool {b_buf.shape[1]}")
    o1, o2, o3 = _offsets_args(slice_offsets, n)
    num_slices = len(slice_offsets)
    r = _check_pool(None, b_buf, num_slices)
    if v.dim() == 2:
        v = v.unsqueeze(0)
    if v.shape[1:] != (t_count, num_slices * r) or v.stride(2) != 1:
        raise ValueError(f"v is {tuple(v.shape)}, expected [splits, {t_count}, {num_slices * r}]")
    if v.dtype != torch.float32:
        v = v.float()
    has_rank = slot_ranks is not None
    rank_arg = slot_ranks if has_rank else token_slot
    if not t_count:
        return y
    if segments is None:
        bn = block_n or 128
        _expand_gather_kernel[(t_count, triton.cdiv(n, bn))](
            v, b_buf, token_slot, rank_arg, y, n, r, v.shape[0], o1, o2, o3,
            v.stride(0), v.stride(1), b_buf.stride(0), b_buf.stride(1), y.stride(0),
            HAS_RANK=has_rank, BLOCK_N=bn, BLOCK_R=triton.next_power_of_2(r),
            SPLIT_CHUNK=SPLIT_CHUNK, num_warps=4,
        )  # fmt: skip
        return y
    block_t, bn = _block_t(segments.max_len), block_n or 128
    g = segments.start.shape[0]
    tiles = triton.cdiv(segments.max_len, block_t)
    if g and tiles:
        _expand_segment_kernel[(g, tiles, triton.cdiv(n, bn))](
            v, b_buf, segments.start, segments.length, segments.slot, rank_arg, y, n, r,
            v.shape[0], o1, o2, o3, v.stride(0), v.stride(1), b_buf.stride(0), b_buf.stride(1),
            y.stride(0), HAS_RANK=has_rank,
            PRECISION="ieee" if b_buf.dtype == torch.float32 else "tf32", DOT_F32=not y.is_cuda,
            BLOCK_T=block_t, BLOCK_N=bn, BLOCK_R=max(16, triton.next_power_of_2(r)), num_warps=4,
        )  # fmt: skip
    return y


# ---- public API -----------------------------------------------------------------------------


def lora_shrink(
    x: torch.Tensor,
    a_buf: torch.Tensor,
    token_slot: torch.Tensor,
    num_slices: int,
    *,
    segments: Segments | None = None,
    slot_ranks: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    block_k: int | None = None,
    reduce: bool = True,
) -> torch.Tensor:
    """``v [T, S*r]``: ``v[t] = a_buf[token_slot[t]] @ x[t]``, zero where the slot is -1.
    With ``segments`` the segment kernel runs (tokens outside them read as -1).
    ``reduce=False``: the fp32 partial sums ``[splits, T, S*r]`` as they are, for
    :func:`lora_expand` (which adds them as it reads, saving a kernel)."""
    v = _shrink_partials(
        x, a_buf, token_slot, num_slices, segments, slot_ranks, num_splits, block_k
    )
    if not reduce:
        return v
    v = v[0] if v.shape[0] == 1 else v.sum(0)
    return v if out_dtype == torch.float32 else v.to(out_dtype)


def lora_expand(
    v: torch.Tensor,
    b_buf: torch.Tensor,
    token_slot: torch.Tensor,
    slice_offsets: Sequence[int],
    y: torch.Tensor,
    *,
    segments: Segments | None = None,
    slot_ranks: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """``y[t, rows of slice j] += b_buf[slot, rows, j*r:(j+1)*r] @ v[t, j*r:(j+1)*r]`` in
    place, for tokens whose slot is not -1; returns ``y``. ``slice_offsets``: host ints, the
    first output row of each slice (``(0,)`` for one slice; at most ``MAX_SLICES``). ``v`` is
    ``[T, S*r]`` or the shrink's partials ``[splits, T, S*r]``."""
    return _expand_partials(v, b_buf, token_slot, slice_offsets, y, segments, slot_ranks, block_n)


def lora_shrink_expand(
    x: torch.Tensor,
    y: torch.Tensor,
    a_buf: torch.Tensor,
    b_buf: torch.Tensor,
    slice_sizes: Sequence[int],
    batch: LoRABatch,
    *,
    slot_ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y += B_slot (A_slot x)`` per token (packed projection of ``slice_sizes``), in place;
    returns ``y``. The segment kernels run when ``batch`` has segments of ``SEGMENT_MIN_RUN``
    tokens or more on average, the gather kernels otherwise (see the module docstring)."""
    segs = batch.segments
    if segs is not None and batch.num_tokens < SEGMENT_MIN_RUN * segs.start.shape[0]:
        segs = None
    v = _shrink_partials(x, a_buf, batch.token_slot, len(slice_sizes), segs, slot_ranks, None, None)
    return _expand_partials(
        v, b_buf, batch.token_slot, _offsets_of(slice_sizes), y, segs, slot_ranks, None
    )
