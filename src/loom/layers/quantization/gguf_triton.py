"""Triton matmul over GGUF weights kept in their raw GGML blocks on the device.

``gguf_matmul(x, raw, qtype)`` is ``x @ W.T`` with ``W`` ``[N, K]`` given as ``raw``
``[N, K / block * bytes]`` uint8, each row the file's bytes for that output row (layouts in
``gguf_blocks``). Two paths, chosen by the number of input rows ``T``:

* ``T <= GEMV_MAX_T`` (one-token decode): a GEMV-style kernel. Each program owns ``BLOCK_N``
  output rows and ``BLOCK_T`` input rows and walks all of K, ``G`` groups at a time. It loads the
  groups' raw bytes (runs of 16 or 32 contiguous bytes per row and group; a row's blocks are
  adjacent, so a tile's loads cover contiguous bytes), decodes them in registers (the fp16 scale
  fields read as two bytes combined into a uint16 and bitcast) as ``w = a q + b`` with one ``a``
  and ``b`` per group half, and accumulates ``a sum q x + b sum x`` in fp32.
* ``T > GEMV_MAX_T`` (prefill, and decode of several rows): a Triton kernel dequantises ``W``
  into a temporary ``[N, K]`` of ``x``'s dtype, then ``torch.matmul`` (cuBLAS) multiplies. That
  costs the temporary's write and read, small beside a prefill's matmul.

Decoding works on *groups*: each group's ``L`` quant bytes give a "low" and a "high" tile of
``L`` weights, at element positions that depend on the type (``_positions``). A group is a whole
block for the 32-element types (``L`` = 16; low: elements 0-15, high: 16-31), a quarter of a
superblock for Q4_K/Q5_K (``L`` = 32: sub-blocks 2i and 2i+1) and an eighth for Q6_K (``L`` = 16,
each half with one of its 16 scales).

Measured on an H200 at T = 1 (bench/gguf_gemv.py, CUDA graphs, weights beyond L2): 1.1-2x the
time of a bf16 matmul of the same shape at 4096 x 4096 (Q4_0 fastest, Q6_K slowest), 1.3-2.8x
at 14336 x 4096 and 4096 x 14336, reading 500-1060 GB/s of raw bytes: the kernel is bound by
its decode arithmetic, not by memory, so it does not yet turn the 2-3.5x fewer bytes into speed.

Both kernels are CUDA-graph safe: no host syncs, shapes only from tensor metadata. Without
Triton or on a CPU tensor outside ``TRITON_INTERPRET=1``, the plain-PyTorch reference
(``gguf_blocks.dequantize_rows``) runs instead.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from loom.layers.quantization.gguf_blocks import BLOCKS, dequantize_rows, row_bytes, type_name

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Input rows up to which the GEMV kernel runs; above, dequantise + torch.matmul. On an H200
# (bench/gguf_gemv.py, N = K = 4096) the kernel takes 14-25 us at T = 1 but 42-53 us at T = 4,
# where dequantising + cuBLAS takes 25-38 us for any T up to 64: the kernel's cost is its
# decode arithmetic (it reaches 500-1000 GB/s of raw bytes, not the memory's ~4 TB/s), which
# it repeats per BLOCK_T slice.
GEMV_MAX_T = 1
# integer codes of the types inside the kernels
_CODE = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


def _group_shape(name: str) -> tuple[int, int]:
    """(groups per block, L: quant bytes per group and elements per half-group)."""
    return {"Q4_K": (4, 32), "Q5_K": (4, 32), "Q6_K": (8, 16)}.get(name, (1, 16))


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _f16(P, mask):
        """The little-endian fp16 at byte pointers ``P``, as fp32."""
        lo = tl.load(P, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(P + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _u8(P, mask):
        return tl.load(P, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _k_scale_min(S, s, mask):
        """Q4_K/Q5_K sub-block ``s``'s 6-bit scale and min (fp32), ``S`` the 12 scale bytes.
        ``s < 4``: scale ``S[s] & 63``, min ``S[s+4] & 63``. ``s >= 4``: scale is ``S[s+4]``'s
        low nibble under ``S[s-4]``'s top two bits, min ``S[s+4]``'s high nibble under
        ``S[s]``'s top two bits."""
        a = _u8(S + s, mask)
        b = _u8(S + s + 4, mask)
        c = _u8(S + tl.where(s >= 4, s - 4, s), mask)
        low = s < 4
        sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _decode(B, sub, j, ok, QTYPE: tl.constexpr):
        """One iteration's groups, as ``w = a * q + b`` for their low and high tiles: returns
        ``q_lo, q_hi`` (integer-valued fp32, ``[BN, G, L]``) and ``a_lo, a_hi, b_lo, b_hi``
        (fp32, ``[BN, G]``: one scale and offset per tile of a group). ``B`` (``[BN, G]``) points
        at each group's block, ``sub`` (``[1, G]``) is the group's index in its block, ``j``
        (``[1, 1, L]``) the byte within the group, ``ok`` (``[BN, G]``) masks groups; masked
        groups decode to zeros."""
        Bq = B[:, :, None]
        okq = ok[:, :, None] & (j >= 0)  # (masks are given their pointers' full shape)
        if QTYPE == 0 or QTYPE == 1:  # Q4_0, Q4_1
            qs = _u8(Bq + 2 + 2 * QTYPE + j, okq)
            q_lo = (qs & 15).to(tl.float32)
            q_hi = (qs >> 4).to(tl.float32)
            a_lo = _f16(B, ok)
            if QTYPE == 0:
                b_lo = -8.0 * a_lo
            else:
                b_lo = _f16(B + 2, ok)
            a_hi = a_lo
            b_hi = b_lo
        elif QTYPE == 2 or QTYPE == 3:  # Q5_0, Q5_1: qh is a little-endian uint32 of high bits
            QH: tl.constexpr = 2 * (QTYPE - 1)  # qh's offset: 2 (Q5_0), 4 (Q5_1)
            qh = (
                _u8(B + QH, ok)
                | (_u8(B + QH + 1, ok) << 8)
                | (_u8(B + QH + 2, ok) << 16)
                | (_u8(B + QH + 3, ok) << 24)
            )[:, :, None]
            qs = _u8(Bq + QH + 4 + j, okq)
            q_lo = ((qs & 15) | (((qh >> j) & 1) << 4)).to(tl.float32)
            q_hi = ((qs >> 4) | (((qh >> (j + 16)) & 1) << 4)).to(tl.float32)
            a_lo = _f16(B, ok)
            if QTYPE == 2:
                b_lo = -16.0 * a_lo
            else:
                b_lo = _f16(B + 2, ok)
            a_hi = a_lo
            b_hi = b_lo
        elif QTYPE == 4:  # Q8_0: the low tile is bytes 0-15 of qs, the high one 16-31
            q_lo = tl.load(Bq + 2 + j, mask=okq, other=0).to(tl.int8, bitcast=True)
            q_hi = tl.load(Bq + 18 + j, mask=okq, other=0).to(tl.int8, bitcast=True)
            q_lo = q_lo.to(tl.float32)
            q_hi = q_hi.to(tl.float32)
            a_lo = _f16(B, ok)
            a_hi = a_lo
            b_lo = tl.zeros_like(a_lo)
            b_hi = b_lo
        elif QTYPE == 5 or QTYPE == 6:  # Q4_K, Q5_K: group `sub` = sub-blocks 2 sub, 2 sub + 1
            d = _f16(B, ok)
            dmin = _f16(B + 2, ok)
            sc_lo, mn_lo = _k_scale_min(B + 4, 2 * sub, ok)
            sc_hi, mn_hi = _k_scale_min(B + 4, 2 * sub + 1, ok)
            QS: tl.constexpr = 16 + 32 * (QTYPE - 5)  # qs's offset: 16 (Q4_K), 48 (Q5_K)
            qs = _u8(Bq + QS + 32 * sub[:, :, None] + j, okq)
            q_lo = qs & 15
            q_hi = qs >> 4
            if QTYPE == 6:  # bit s of qh[j] is sub-block s's fifth bit
                qh = _u8(Bq + 16 + j, okq)
                s2 = 2 * sub[:, :, None]
                q_lo = q_lo | (((qh >> s2) & 1) << 4)
                q_hi = q_hi | (((qh >> (s2 + 1)) & 1) << 4)
            q_lo = q_lo.to(tl.float32)
            q_hi = q_hi.to(tl.float32)
            a_lo = d * sc_lo
            a_hi = d * sc_hi
            b_lo = -(dmin * mn_lo)
            b_hi = -(dmin * mn_hi)
        else:  # Q6_K: group sub = 4 h + r (16 bytes each): ql[64 h + 16 r + j], qh[32 h + 16 (r % 2) + j]
            h = sub // 4
            r = sub % 4
            hq = h[:, :, None]
            rq = r[:, :, None]
            ql = _u8(Bq + 64 * hq + 16 * rq + j, okq)
            qh = _u8(Bq + 128 + 32 * hq + 16 * (rq % 2) + j, okq)
            p2 = 2 * (rq // 2)  # qh's shift for the low tile (elements 128 h + 16 r + j)
            q_lo = ((ql & 15) | (((qh >> p2) & 3) << 4)).to(tl.float32)
            q_hi = ((ql >> 4) | (((qh >> (p2 + 4)) & 3) << 4)).to(tl.float32)
            d = _f16(B + 208, ok)
            s_lo = tl.load(B + 192 + 8 * h + r, mask=ok, other=0).to(tl.int8, bitcast=True)
            s_hi = tl.load(B + 196 + 8 * h + r, mask=ok, other=0).to(tl.int8, bitcast=True)
            a_lo = d * s_lo.to(tl.float32)
            a_hi = d * s_hi.to(tl.float32)
            b_lo = -32.0 * a_lo
            b_hi = -32.0 * a_hi
        return q_lo, q_hi, a_lo, a_hi, b_lo, b_hi

    @triton.jit
    def _positions(blk, sub, j, QTYPE: tl.constexpr):
        """Element indices along K (``[1, G, L]``) of the low and high tiles of the groups
        ``(blk, sub)`` (``[1, G, 1]``)."""
        if QTYPE <= 4:  # 32-element blocks: low = elements 0-15, high = 16-31
            k_lo = blk * 32 + j
            k_hi = k_lo + 16
        elif QTYPE <= 6:  # Q4_K/Q5_K: sub-blocks 2 sub (low) and 2 sub + 1 (high)
            k_lo = blk * 256 + 64 * sub + j
            k_hi = k_lo + 32
        else:  # Q6_K: 128 h + 16 r + j (low) and 64 further (high)
            k_lo = blk * 256 + 128 * (sub // 4) + 16 * (sub % 4) + j
            k_hi = k_lo + 64
        return k_lo, k_hi

    @triton.jit
    def _gemv_kernel(
        X, RAW, Y, T, N, n_groups, stride_x, stride_y, stride_raw,
        QTYPE: tl.constexpr, BYTES: tl.constexpr, GPB: tl.constexpr, L: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        """``Y[t, n] = sum_k X[t, k] W[n, k]`` for ``BLOCK_T`` rows ``t`` and ``BLOCK_N`` rows
        ``n``, W decoded from ``RAW`` ``G`` groups at a time (``GPB`` groups a block of
        ``BYTES`` bytes). With ``w = a q + b`` per tile, a tile contributes
        ``a sum_j q x + b sum_j x``: the scales multiply per group, not per element."""
        pid_t = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        row_ptr = RAW + rows.to(tl.int64)[:, None] * stride_raw  # [BN, 1]
        ts = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        j = tl.arange(0, L)[None, None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        acc_g = tl.zeros([BLOCK_N, G], dtype=tl.float32)  # BLOCK_T == 1: reduced over G once
        for g0 in range(0, n_groups, G):
            g = g0 + tl.arange(0, G)[None, :]  # [1, G]
            g_ok = g < n_groups
            blk = g // GPB
            sub = g % GPB
            ok = row_ok[:, None] & g_ok
            q_lo, q_hi, a_lo, a_hi, b_lo, b_hi = _decode(row_ptr + blk * BYTES, sub, j, ok, QTYPE)
            k_lo, k_hi = _positions(blk[:, :, None], sub[:, :, None], j, QTYPE)
            gj_ok = g_ok[:, :, None] & (j >= 0)
            for tt in tl.static_range(BLOCK_T):
                t = pid_t * BLOCK_T + tt
                x_ok = gj_ok & (tl.full([1, 1, 1], t, tl.int32) < T)  # (a bool tensor)
                xrow = X + t.to(tl.int64) * stride_x
                x_lo = tl.load(xrow + k_lo, mask=x_ok, other=0.0).to(tl.float32)
                x_hi = tl.load(xrow + k_hi, mask=x_ok, other=0.0).to(tl.float32)
                part = (
                    a_lo * tl.sum(q_lo * x_lo, axis=2)
                    + a_hi * tl.sum(q_hi * x_hi, axis=2)
                    + b_lo * tl.sum(x_lo, axis=2)
                    + b_hi * tl.sum(x_hi, axis=2)
                )  # [BN, G]
                if BLOCK_T == 1:
                    acc_g += part
                else:
                    acc = tl.where(ts[:, None] == t, acc + tl.sum(part, axis=1)[None, :], acc)
        if BLOCK_T == 1:
            acc = tl.sum(acc_g, axis=1)[None, :]
        y_ptr = Y + ts.to(tl.int64)[:, None] * stride_y + rows[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(ts < T)[:, None] & row_ok[None, :])

    @triton.jit
    def _dequant_kernel(
        RAW, OUT, N, n_groups, stride_raw, stride_out,
        QTYPE: tl.constexpr, BYTES: tl.constexpr, GPB: tl.constexpr, L: tl.constexpr,
        BLOCK_N: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        """``OUT[n, k] = W[n, k] = a q + b`` for ``BLOCK_N`` rows and ``G`` groups of each."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        g = tl.program_id(1) * G + tl.arange(0, G)[None, :]
        g_ok = g < n_groups
        blk = g // GPB
        sub = g % GPB
        j = tl.arange(0, L)[None, None, :]
        ok = row_ok[:, None] & g_ok
        row_ptr = RAW + rows.to(tl.int64)[:, None] * stride_raw
        q_lo, q_hi, a_lo, a_hi, b_lo, b_hi = _decode(row_ptr + blk * BYTES, sub, j, ok, QTYPE)
        k_lo, k_hi = _positions(blk[:, :, None], sub[:, :, None], j, QTYPE)
        out = OUT + rows.to(tl.int64)[:, None, None] * stride_out
        okq = ok[:, :, None] & (j >= 0)
        w_lo = a_lo[:, :, None] * q_lo + b_lo[:, :, None]
        w_hi = a_hi[:, :, None] * q_hi + b_hi[:, :, None]
        tl.store(out + k_lo, w_lo.to(OUT.dtype.element_ty), mask=okq)
        tl.store(out + k_hi, w_hi.to(OUT.dtype.element_ty), mask=okq)


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _check(raw: torch.Tensor, name: str, k: int) -> None:
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(k, name):
        raise ValueError(
            f"raw blocks of {name} for rows of {k} elements must be uint8 "
            f"[N, {row_bytes(k, name)}], got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.stride(1) != 1:
        raise ValueError("raw blocks must be contiguous along a row")


def _default_config(name: str, t: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, G, num_warps) for the GEMV kernel: the fastest at T=1 of a sweep on an
    H200 at N = K = 4096 (bench/gguf_gemv.py --sweep): 512 elements per row and iteration over
    8 rows with 4 warps, for Q4_K/Q5_K 256 elements over 16 rows with 8 warps."""
    block_t = 1 if t == 1 else min(4, triton.next_power_of_2(t))
    if name in ("Q4_K", "Q5_K"):
        return block_t, 16, 4, 8
    _, lw = _group_shape(name)
    return block_t, 8, 512 // (2 * lw), 4


def gguf_matmul(
    x: torch.Tensor,
    raw: torch.Tensor,
    qtype,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[..., K]`` (bf16/fp16/fp32) and ``W`` ``[N, K]`` as GGML blocks
    ``raw`` (uint8 ``[N, K / block * bytes]``), in ``x``'s dtype; fp32 accumulation.
    ``config`` = ``(BLOCK_T, BLOCK_N, G, num_warps)`` overrides the GEMV kernel's choice (and
    forces the GEMV path)."""
    name = type_name(qtype)
    k = x.shape[-1]
    _check(raw, name, k)
    n = raw.shape[0]
    x2 = x.reshape(-1, k)
    t = x2.shape[0]
    if not _use_triton(x2):
        y = (x2.float() @ dequantize_rows(raw, name).T).to(x.dtype)
        return y.reshape(*x.shape[:-1], n)
    if t > GEMV_MAX_T and config is None:
        w = gguf_dequantize(raw, name, dtype=x.dtype)
        return torch.matmul(x2, w.T).reshape(*x.shape[:-1], n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    size, nbytes = BLOCKS[name]
    gpb, lw = _group_shape(name)
    block_t, block_n, g, warps = config or _default_config(name, t)
    grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n))
    _gemv_kernel[grid](
        x2, raw, y, t, n, k // size * gpb, x2.stride(0), y.stride(0), raw.stride(0),
        QTYPE=_CODE[name], BYTES=nbytes, GPB=gpb, L=lw,
        BLOCK_T=block_t, BLOCK_N=block_n, G=g, num_warps=warps,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def gguf_dequantize(
    raw: torch.Tensor,
    qtype,
    dtype: torch.dtype = torch.float32,
    *,
    block_n: int = 16,
    groups: int | None = None,
) -> torch.Tensor:
    """``raw`` (uint8 ``[N, blocks * bytes]``) as ``[N, K]`` of ``dtype``, decoded by Triton
    (``dequantize_rows`` when Triton cannot run on ``raw``'s device); ``groups`` per program
    along K (default: 256 elements)."""
    name = type_name(qtype)
    size, nbytes = BLOCKS[name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"want uint8 [N, blocks * {nbytes}] for {name}, got {tuple(raw.shape)}")
    if not _use_triton(raw):
        return dequantize_rows(raw, name).to(dtype)
    n = raw.shape[0]
    k = raw.shape[1] // nbytes * size
    gpb, lw = _group_shape(name)
    n_groups = k // size * gpb
    g = groups or 256 // (2 * lw)
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(n_groups, g))
    _dequant_kernel[grid](
        raw, out, n, n_groups, raw.stride(0), out.stride(0),
        QTYPE=_CODE[name], BYTES=nbytes, GPB=gpb, L=lw, BLOCK_N=block_n, G=g,
    )  # fmt: skip
    return out
