"""Triton kernels for ``--quantization fp8`` on GPUs with FP8 support (compute capability 8.9+).

``fp8_gemv(x, w, scale)`` is ``x @ (w * scale[:, None]).T`` for one row of ``x`` (batch-1
decode): ``w`` ``[N, K]`` float8_e4m3fn, ``scale`` ``[N]`` fp32, ``x`` ``[1, K]`` bf16 / fp16,
fp32 accumulation, output in ``x``'s dtype. Decode is bound by reading the weights, so the
kernel streams them once, one byte per weight, in 16-byte loads along K; the activations are a
few KB and stay in L1/L2. Each program owns ``BLOCK_N`` weight rows and one of ``SPLIT_K``
slices of K, walking it ``BLOCK_K`` columns at a time with CUDA-core FMAs into an fp32
``[BLOCK_N, BLOCK_K]`` accumulator, reduced across threads once after the loop (a reduction per
iteration would put shuffles and shared-memory round trips into the streaming loop).

``fp8_skinny(x, w, scale)`` is the same product for 2-16 rows through FP8 tensor-core dots
(``_skinny_kernel``): the activations are scaled to E4M3 per row and block of columns, so the
weights go to the tensor cores as stored, with no conversion.

With ``SPLIT_K > 1`` each slice writes fp32 partials ``[SPLIT_K, M, N]`` and a second kernel sums
them in a fixed order (deterministic, unlike fp32 atomics) and casts. Split-K runs only where N
alone gives too few programs to keep every SM streaming (small N: tensor-parallel shards). The
per-channel scale multiplies once per output; the bias (if any) is added in fp32 before the one
rounding to ``x``'s dtype.

``quantize_per_token(x)`` is the activation quantization of the ``torch._scaled_mm`` path for
larger M in one kernel: each row's absmax, ``scale = max(absmax / 448, 1e-12)`` and
``q = clamp(x / scale, +-448)`` as E4M3, bit for bit the PyTorch five-op reference
(``_quantize_per_token_torch``): IEEE divisions (``div_rn``), and round-to-nearest-even done in
fp32 before the cast, so the cast is exact on the GPU and in Triton's interpreter (whose own
fp8 rounding is not round-to-nearest-even).

Both are CUDA-graph safe: no host syncs, launch parameters from shapes only, outputs from
``torch.empty``. A kernel compiles on its shape class's first call, which the engine makes
eagerly before capturing graphs. Without Triton, or on a CPU tensor outside
``TRITON_INTERPRET=1``, the PyTorch references run instead.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448 (written as 448.0 inside the kernels)
# Rows up to which ``Fp8LinearMethod`` takes ``fp8_skinny`` (one row: ``fp8_gemv``); above,
# quantize_per_token + ``torch._scaled_mm``. The skinny kernel pads the rows to 16 for the
# tensor cores, so up to 16 rows its time is the weight stream's (at 4 rows on the H200 0.6-0.9x
# of _scaled_mm's, whose FP8 GEMM tiles suit more rows).
SKINNY_MAX_M = 16
# Programs per SM the GEMV's split-K aims for where N alone gives fewer than half of them:
# several resident programs, each with a few 4 KB tiles of loads in flight (pipelined), are what
# cover the memory latency (~25 KB in flight per SM for ~4.8 TB/s at ~0.7 us).
PROGRAMS_PER_SM = 4


class TileConfig(NamedTuple):
    """A launch of ``_gemv_kernel`` (one row) or ``_skinny_kernel`` (2 to 16 rows): each
    program's weight tile, the K slices, warps and pipeline stages."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_out(
        out, S, B, Y, P, rows, row_ok, ms, m_ok, pid_k, M, N, stride_ym,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """``out`` ``[BLOCK_M, BLOCK_N]`` (fp32 sums of ``rows``) times the rows' scales: into
        ``Y`` with the bias (one slice), or as slice ``pid_k``'s fp32 partials into ``P``."""
        out = out * tl.load(S + rows, mask=row_ok, other=0.0)[None, :]
        ok = m_ok[:, None] & row_ok[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                out += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
            y_ptr = Y + ms.to(tl.int64)[:, None] * stride_ym + rows[None, :]
            tl.store(y_ptr, out.to(Y.dtype.element_ty), mask=ok)
        else:
            p_ptr = P + (pid_k * M + ms.to(tl.int64))[:, None] * N + rows[None, :]
            tl.store(p_ptr, out, mask=ok)

    @triton.jit
    def _gemv_kernel(
        X, W, S, B, Y, P, N, K, k_split, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """Rows ``BLOCK_N * pid_n ...`` of ``Y = X @ (W * S).T`` for X's one row, over K slice
        ``pid_k`` (``k_split`` columns, a multiple of ``BLOCK_K``, so a tile never straddles
        two slices)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        ks = tl.arange(0, BLOCK_K)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        w_ptr = W + rows.to(tl.int64)[:, None] * stride_wn + (k_lo + ks)[None, :]
        x_ptr = X + k_lo + ks
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + ks) < K
            w = tl.load(w_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        one = tl.arange(0, 1)
        _store_out(
            tl.sum(acc, axis=1)[None, :], S, B, Y, P, rows, row_ok, one, one < 1, pid_k, 1, N,
            0, HAS_BIAS, SPLIT_K,
        )  # fmt: skip

    @triton.jit
    def _split_sum_kernel(
        P, B, Y, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr
    ):
        """``Y = sum_s P[s] (+ bias)`` for contiguous ``Y`` ``[M, N]``, slices in order."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(P + s * M * N + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _round_e4m3(v):
        """``v`` (fp32, within +-448) rounded to the nearest E4M3 value, ties to even, as fp32:
        normal results (>= 2^-6) keep 3 of fp32's 23 mantissa bits (a carry may raise the
        exponent), subnormal ones are multiples of 2^-9 (fp32's spacing at 2^14, so adding and
        subtracting 2^14 rounds there). The sign is copied bitwise (-0.0 stays -0.0)."""
        vb = v.to(tl.int32, bitcast=True)
        a = tl.abs(v)
        ab = a.to(tl.int32, bitcast=True)
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        sub = (a + 16384.0) - 16384.0
        r = tl.where(a >= 0.015625, normal, sub).to(tl.int32, bitcast=True)
        return (r | (vb & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _quant_kernel(
        X, Q, S, K, stride_xm, stride_qm, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr
    ):
        """Row ``pid`` of ``X`` as E4M3 ``Q`` and its scale ``S`` (the five-op reference's
        numbers: absmax exact in fp32, IEEE divisions)."""
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_xm
        q_row = Q + row * stride_qm
        ks = tl.arange(0, BLOCK)
        if ONE_PASS:  # the row fits one block: read it once
            ok = ks < K
            x = tl.load(x_row + ks, mask=ok, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        else:
            vmax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                xk = tl.load(x_row + k0 + ks, mask=(k0 + ks) < K, other=0.0).to(tl.float32)
                vmax = tl.maximum(vmax, tl.abs(xk))
            amax = tl.max(vmax, axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
        tl.store(S + row, scale)
        if ONE_PASS:
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_row + ks, _round_e4m3(q).to(Q.dtype.element_ty), mask=ok)
        else:
            for k0 in range(0, K, BLOCK):
                ok = (k0 + ks) < K
                xk = tl.load(x_row + k0 + ks, mask=ok, other=0.0).to(tl.float32)
                q = tl.minimum(tl.maximum(tl.math.div_rn(xk, scale), -448.0), 448.0)
                tl.store(q_row + k0 + ks, _round_e4m3(q).to(Q.dtype.element_ty), mask=ok)

    @triton.jit
    def _skinny_kernel(
        X, W, S, B, Y, P, M, N, K, k_split, stride_xm, stride_wn, stride_ym,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr,
    ):  # fmt: skip
        """Rows ``BLOCK_N * pid_n ...`` of ``Y = X @ (W * S).T`` over K slice ``pid_k`` with
        FP8 tensor-core dots: each ``BLOCK_K`` block of X's rows is scaled to E4M3 by its own
        absolute maximum (``skinny_reference``), dotted with the E4M3 weight tile as it is
        stored, and the fp32 block sum is scaled back into an fp32 accumulator. The weight
        tile is the dot's M side (``BLOCK_N`` >= 64 rows) and X's few rows, padded to
        ``BLOCK_M`` = 16, its N side. ``EMULATE`` (Triton's interpreter): the same numbers
        through an fp32 dot and an exact round to E4M3."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < M
        ks = tl.arange(0, BLOCK_K)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        w_ptr = W + rows.to(tl.int64)[:, None] * stride_wn + (k_lo + ks)[None, :]
        x_ptr = X + ms.to(tl.int64)[:, None] * stride_xm + (k_lo + ks)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + ks) < K
            w = tl.load(w_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
            # (an fp32 division: a Python number's would run in fp64 in the interpreter)
            inv = tl.math.div_rn(tl.full([BLOCK_M], 448.0, tl.float32), tl.maximum(amax, 1e-30))
            inv = tl.where(amax > 0, inv, 0.0)
            xs = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
            if EMULATE:
                xq = _round_e4m3(xs)
                part = tl.dot(w.to(tl.float32), tl.trans(xq), input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(xs.to(W.dtype.element_ty)))
            acc += part * (amax / 448.0)[None, :]
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        _store_out(
            tl.trans(acc), S, B, Y, P, rows, row_ok, ms, m_ok, pid_k, M, N, stride_ym,
            HAS_BIAS, SPLIT_K,
        )  # fmt: skip


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _num_sms(index: int | None) -> int:
    if index is None:  # Triton's interpreter on the CPU: an H200's count, so tiles match it
        return 132
    return torch.cuda.get_device_properties(index).multi_processor_count


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def gemv_config(n: int, k: int, num_sms: int = 132) -> TileConfig:
    """The launch for one row of ``[n, k]`` weights: 8 x 1024 tiles (the H200's best of 2-8 KB
    tiles at 4096 x 4096, 28672 x 4096 and 4096 x 14336: 7.2, 34.4 and 17.7 us, against 8.1,
    40.4 and 20.3 for 2 x 2048; ``bench/fp8_gemv.py --sweep``); split-K when N gives fewer than
    ``PROGRAMS_PER_SM / 2`` programs per SM, to about ``PROGRAMS_PER_SM`` per SM."""
    block_n, block_k = 8, min(1024, max(16, _pow2_ceil(k)))
    return TileConfig(block_n, block_k, _split(n, k, block_n, block_k, num_sms))


def _split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    programs = -(-n // block_n)
    target = PROGRAMS_PER_SM * num_sms
    if 2 * programs >= target:
        return 1
    return min(-(-target // programs), -(-k // block_k), 16)


def _gemv_torch(x2, w, scale, bias):
    y = x2.float() @ (w.float() * scale.float()[:, None]).T
    if bias is not None:
        y += bias.float()
    return y.to(x2.dtype)


def _check_weights(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    k = x.shape[-1]
    if w.dtype != FP8 or w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"{name}: want float8_e4m3fn [N, {k}] contiguous along K, got "
                         f"{w.dtype} {tuple(w.shape)}")  # fmt: skip
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name} takes bf16 / fp16 activations, got {x.dtype}")


def _launch_split(part, bias, scale, y, m: int, n: int, split: int) -> None:
    """Sum the split-K partials into ``y`` (with the bias)."""
    block = 1024
    _split_sum_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else scale, y, m, n,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block,
    )  # fmt: skip


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x @ (w * scale[:, None]).T (+ bias)`` for one row ``x`` ``[..., K]`` (leading dims
    of size 1) bf16 / fp16, ``w`` ``[N, K]`` float8_e4m3fn (contiguous along K), ``scale``
    ``[N]`` fp32; in ``x``'s dtype, fp32 accumulation. ``config`` overrides ``gemv_config``."""
    _check_weights(x, w, "fp8_gemv")
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    if x2.shape[0] != 1:
        raise ValueError(f"fp8_gemv multiplies one row, got {x2.shape[0]} (fp8_skinny: 2-16)")
    if not _use_triton(x2):
        return _gemv_torch(x2, w, scale, bias).reshape(*x.shape[:-1], n)
    x2 = x2.contiguous()
    scale = scale.reshape(n).float().contiguous()
    if config is None:
        config = gemv_config(n, k, _num_sms(x2.device.index if x2.is_cuda else None))
    block_n, block_k, split, warps, stages = config
    k_split = -(-k // (block_k * split)) * block_k
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, 1, n, dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else scale  # (an unread pointer without a bias)
    _gemv_kernel[(triton.cdiv(n, block_n), split)](
        x2, w, scale, b, y, part, n, k, k_split, w.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _launch_split(part, bias, scale, y, 1, n, split)
    return y.reshape(*x.shape[:-1], n)


def _quantize_per_token_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: five PyTorch ops (abs, amax, divide, clamp, cast)."""
    # (divided by a tensor: IEEE division on every device; CUDA divides a tensor by a Python
    # number as a multiplication by its reciprocal, one ulp away)
    amax = x2.abs().amax(dim=-1, keepdim=True).float()
    x_scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=1e-12)
    return (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), x_scale


# Row elements one program holds in registers at once (the whole row up to this: one read).
QUANT_BLOCK = 16384


def quantize_per_token(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` ``[M, K]`` (bf16 / fp16 / fp32) as E4M3 ``q`` ``[M, K]`` and fp32 per-row
    scales ``[M, 1]`` with ``x2 ~ q * scale``: one kernel, one program per row."""
    m, k = x2.shape
    if not _use_triton(x2) or m == 0 or k == 0:
        return _quantize_per_token_torch(x2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(m, k, dtype=FP8, device=x2.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    block = min(QUANT_BLOCK, _pow2_ceil(k))
    warps = max(1, min(16, block // 1024))  # 32 elements a thread from 1024 up
    _quant_kernel[(m,)](
        x2, q, s, k, x2.stride(0), q.stride(0), BLOCK=block, ONE_PASS=k <= block, num_warps=warps
    )
    return q, s


def skinny_config(m: int, n: int, k: int, num_sms: int = 132) -> TileConfig:
    """128 weight rows a tile, by 128 columns (64 for weights of at most 32M values), 8 warps,
    3 stages: the H200's best at 4 rows (``bench/fp8_gemv.py --sweep``: 11.3 us at 4096 x 4096,
    35.6 at 28672 x 4096, 22.0 at 4096 x 14336; bf16 12.4, 56.5, 31.3); split-K up to about
    ``PROGRAMS_PER_SM`` programs per SM where N alone gives fewer than half of them."""
    block_n = 128
    block_k = min(64 if n * k <= 1 << 25 else 128, max(32, _pow2_ceil(k)))
    return TileConfig(block_n, block_k, _split(n, k, block_n, block_k, num_sms), 8, 3)


def skinny_reference(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_k: int):
    """``fp8_skinny``'s numbers in PyTorch (fp32): X's rows in ``block_k`` blocks, each scaled
    to E4M3 by its absolute maximum (``x * (448 / amax)``, rounded to nearest even), dotted
    with the stored weights, scaled back by ``amax / 448`` and summed, times each weight row's
    scale."""
    m, k = x2.shape
    wf = w.float()
    y = torch.zeros(m, w.shape[0], dtype=torch.float32, device=x2.device)
    for k0 in range(0, k, block_k):
        xb = x2[:, k0 : k0 + block_k].float()
        amax = xb.abs().amax(dim=-1, keepdim=True)
        # (a tensor divided by a tensor: IEEE division; a Python number divided by a tensor
        # is a multiplication by its reciprocal)
        inv = torch.full_like(amax, 448.0) / amax.clamp(min=1e-30)
        inv = torch.where(amax > 0, inv, torch.zeros_like(amax))
        xq = (xb * inv).clamp(-448.0, 448.0).to(FP8).float()
        y += (xq @ wf[:, k0 : k0 + block_k].T) * (amax / 448.0)
    return y * scale.float()[None, :]


def fp8_skinny(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x @ (w * scale[:, None]).T (+ bias)`` for 1-16 rows of bf16 / fp16 ``x`` ``[..., K]``
    through FP8 tensor-core dots (``_skinny_kernel``): ``w`` ``[N, K]`` E4M3 contiguous along
    K, ``scale`` ``[N]`` fp32; output in ``x``'s dtype."""
    _check_weights(x, w, "fp8_skinny")
    k, n = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > 16:
        raise ValueError(f"fp8_skinny takes at most 16 rows, got {m}")
    if not _use_triton(x2) or m == 0:
        block = (config or skinny_config(m, n, k)).block_k
        y = skinny_reference(x2, w, scale, block)
        y = y if bias is None else y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    x2 = x2.contiguous()
    scale = scale.reshape(n).float().contiguous()
    if config is None:
        config = skinny_config(m, n, k, _num_sms(x2.device.index if x2.is_cuda else None))
    block_n, block_k, split, warps, stages = config
    k_split = -(-k // (block_k * split)) * block_k
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else scale  # (an unread pointer without a bias)
    _skinny_kernel[(triton.cdiv(n, block_n), split)](
        x2, w, scale, b, y, part, m, n, k, k_split, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, EMULATE=not x2.is_cuda, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _launch_split(part, bias, scale, y, m, n, split)
    return y.reshape(*x.shape[:-1], n)
