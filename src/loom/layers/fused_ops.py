"""Fused Triton kernels for the small per-layer ops of a decoder: residual-add + RMSNorm, rotary
embedding (in place, with the per-head q/k RMSNorm some models apply before it), SiLU-and-mul. On a GPU each replaces 2-16 separate kernels; inside a CUDA
graph a kernel still costs ~2 us, which made these ops about a third of a Llama-3-8B decode step
(measured in docs/benchmarks.md). Layers call them for CUDA tensors only; the plain-PyTorch
paths in the layers are the reference they are tested against (on CPU under TRITON_INTERPRET=1).

Arithmetic is done in fp32 and rounded once at the end, so in bf16 the results can differ from
the PyTorch paths (which round after every op) by one bf16 ulp.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rmsnorm_kernel(
        X,
        R,
        W,
        Out,
        ResOut,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        N,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (
                x.to(tl.float32)
                + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            ).to(x.dtype)
            tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        y = (h * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * stride_o + cols, (w * y).to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_halves(x1, x2, W, offs, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, DTYPE):
        """RMSNorm of each head row given as its two halves (fp32), rounded as
        ``_add_rmsnorm_kernel`` rounds: the normalised value, then its product with ``W``."""
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        y1 = (x1 * rstd[:, None]).to(DTYPE).to(tl.float32)
        y2 = (x2 * rstd[:, None]).to(DTYPE).to(tl.float32)
        return (w1 * y1).to(DTYPE).to(tl.float32), (w2 * y2).to(DTYPE).to(tl.float32)

    @triton.jit
    def _rotary_kernel(
        Q,
        K,
        V,
        Cos,
        Sin,
        KCache,
        VCache,
        Loc,
        QW,
        KW,
        eps,
        stride_q,
        stride_k,
        stride_v,
        stride_c,
        stride_kc,
        stride_vc,
        num_q_heads,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        HEADS: tl.constexpr,
        HEADS_BLOCK: tl.constexpr,
        STORE: tl.constexpr,
        CLAMP: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # One program per (token, group of HEADS heads): a [HEADS, HALF] tile. HEADS divides
        # both head counts, so a group is all q heads (rotated in place) or all k heads (rotated
        # in place, or with STORE written rotated into the KV cache at the token's slot
        # together with the token's v heads). Few tokens (decode) take HEADS = 1 for more
        # programs; many (prefill) take larger groups for fewer, fuller ones. NORM: each head is
        # RMS-normalised first (Qwen3's and Gemma 3's q/k norms, weights QW and KW).
        t = tl.program_id(0)
        h0 = tl.program_id(1) * HEADS
        offs = tl.arange(0, BLOCK)
        hs = tl.arange(0, HEADS_BLOCK)
        mask = (offs[None, :] < HALF) & (hs[:, None] < HEADS)
        cos = tl.load(Cos + t * stride_c + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        sin = tl.load(Sin + t * stride_c + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        cos = cos[None, :]
        sin = sin[None, :]
        cols = hs[:, None] * HEAD_DIM + offs[None, :]
        if h0 < num_q_heads:
            base = Q + t * stride_q + h0 * HEAD_DIM
            x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            if NORM:
                x1, x2 = _norm_halves(x1, x2, QW, offs, eps, HEAD_DIM, HALF, Q.dtype.element_ty)
            tl.store(base + cols, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=mask)
            tl.store(base + HALF + cols, (x2 * cos + x1 * sin).to(Q.dtype.element_ty), mask=mask)
        else:
            kh = h0 - num_q_heads
            base = K + t * stride_k + kh * HEAD_DIM
            x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
            if NORM:
                x1, x2 = _norm_halves(x1, x2, KW, offs, eps, HEAD_DIM, HALF, K.dtype.element_ty)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            if STORE:
                slot = tl.load(Loc + t)
                vsrc = V + t * stride_v + kh * HEAD_DIM
                v1 = tl.load(vsrc + cols, mask=mask, other=0.0).to(tl.float32)
                v2 = tl.load(vsrc + HALF + cols, mask=mask, other=0.0).to(tl.float32)
                if CLAMP > 0:  # an fp8 cache: clamp to the format's range, as KVPool.set_kv
                    o1 = tl.minimum(tl.maximum(o1, -CLAMP), CLAMP)
                    o2 = tl.minimum(tl.maximum(o2, -CLAMP), CLAMP)
                    v1 = tl.minimum(tl.maximum(v1, -CLAMP), CLAMP)
                    v2 = tl.minimum(tl.maximum(v2, -CLAMP), CLAMP)
                kdst = KCache + slot * stride_kc + kh * HEAD_DIM
                vdst = VCache + slot * stride_vc + kh * HEAD_DIM
                tl.store(kdst + cols, o1.to(KCache.dtype.element_ty), mask=mask)
                tl.store(kdst + HALF + cols, o2.to(KCache.dtype.element_ty), mask=mask)
                tl.store(vdst + cols, v1.to(VCache.dtype.element_ty), mask=mask)
                tl.store(vdst + HALF + cols, v2.to(VCache.dtype.element_ty), mask=mask)
            else:
                tl.store(base + cols, o1.to(K.dtype.element_ty), mask=mask)
                tl.store(base + HALF + cols, o2.to(K.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(X, Out, stride_x, stride_o, D, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col0 = tl.program_id(1) * BLOCK
        cols = col0 + tl.arange(0, BLOCK)
        mask = cols < D
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x + residual)`` and the new residual ``x + residual`` (or ``norm(x)``)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    _add_rmsnorm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        res_out,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# From this many tokens a rotary program takes a group of heads (another compiled variant)
ROTARY_GROUPED_FROM = 64


def rotary_heads_per_program(num_tokens: int, num_q: int, num_k: int) -> int:
    """Heads per rotary program: 1 for few tokens (decode: parallelism across heads); for 64 or
    more tokens the largest divisor of both head counts up to 8 (Llama-3-8B: 8, i.e. 5 programs
    a token instead of 40; on the H200 the one-head programs took 205 us a layer for an
    8,192-token prefill, ~4x the time its bytes need)."""
    return 1 if num_tokens < ROTARY_GROUPED_FROM else _head_group(num_q, num_k)


@functools.cache
def _head_group(num_q: int, num_k: int) -> int:
    g = math.gcd(num_q, num_k)
    return max(d for d in range(1, min(g, 8) + 1) if g % d == 0)


def rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    loc: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotate ``q [T, Hq * D]`` and ``k [T, Hk * D]`` in place (row strides may exceed the
    width: they can be column slices of a fused qkv output). ``cos``/``sin`` are ``[T, D/2]``.
    ``qk_norm``: (q weight, k weight, eps) of an RMSNorm over each head, applied first.

    With ``k_cache``/``v_cache`` (``[slots, Hk, D]``) and ``loc`` (``[T]`` slots), the rotated
    k and the unchanged ``v`` are written into the caches instead (``k`` is left as it was):
    the KV store of the attention layer, fused into this kernel. An fp8 cache gets values
    clamped to its range (``KVPool.set_kv``'s rule)."""
    half = head_dim // 2
    cos = cos.reshape(cos.shape[0], -1)
    sin = sin.reshape(sin.shape[0], -1)
    num_q, num_k = q.shape[1] // head_dim, k.shape[1] // head_dim
    store = k_cache is not None
    if store:
        kc, vc = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)
    else:
        v, kc, vc, loc = k, k, k, k  # unused
    if q.shape[0] == 0:
        return
    heads = rotary_heads_per_program(q.shape[0], num_q, num_k)
    qw, kw, eps = qk_norm if qk_norm is not None else (cos, cos, 0.0)
    _rotary_kernel[(q.shape[0], (num_q + num_k) // heads)](
        q,
        k,
        v,
        cos,
        sin,
        kc,
        vc,
        loc,
        qw,
        kw,
        eps,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos.stride(0),
        kc.stride(0),
        vc.stride(0),
        num_q,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        HEADS=heads,
        HEADS_BLOCK=triton.next_power_of_2(heads),
        STORE=store,
        CLAMP=float(torch.finfo(k_cache.dtype).max) if store and k_cache.dtype in _FP8 else 0.0,
        NORM=qk_norm is not None,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        x2, out, x2.stride(0), out.stride(0), d, BLOCK=block
    )
    return out.view(*x.shape[:-1], d)


def use_fused(x: torch.Tensor) -> bool:
    """Fused kernels run on CUDA tensors; CPU keeps the plain PyTorch paths."""
    return HAS_TRITON and x.is_cuda
