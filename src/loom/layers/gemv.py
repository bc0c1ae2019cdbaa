"""A Triton GEMV for one-token decode: ``y = x @ W.T`` with ``x`` one row and ``W`` an
``nn.Linear`` weight ``[N, K]`` (row-major).

Batch-1 decode of a large model is a sequence of GEMVs that read every weight once; the step
can go no faster than the weights' bytes over the memory bandwidth. Each program reads a
``[BLOCK_N, BLOCK_K]`` tile per iteration along K (contiguous, so loads coalesce), multiplies
it by the matching slice of ``x`` in fp32 and reduces once at the end.

Which of cuBLAS (``F.linear``) and this kernel runs is decided per weight shape the first time
the shape is seen on a CUDA device (before any CUDA graph capture, which runs every shape
eagerly first): both are timed and the faster one is kept. On the H200 the kernel won on every
Llama-3-8B shape and cuBLAS on SmolLM2's LM head. The reference is ``torch.nn.functional.linear``
(tests/test_gemv.py, on CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON:
    import triton
    import triton.language as tl

    def _configs():
        return [
            triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            # The winners per Llama-3-8B / SmolLM2 shape on an H200 (bench/gemv_micro.py over
            # 44 configurations, docs/benchmarks.md), plus neighbours.
            for bn, bk, w, s in [
                (2, 1024, 4, 2),
                (2, 1024, 4, 3),
                (4, 1024, 4, 3),
                (8, 1024, 4, 3),
                (4, 256, 4, 4),
                (8, 512, 4, 3),
                (16, 256, 4, 3),
            ]
        ]

    @triton.jit
    def _gemv_kernel(
        X, W, B, Y, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(X + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(
                W + rows[:, None] * stride_w + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)

    _gemv_tuned = triton.autotune(configs=_configs(), key=["N", "K"])(_gemv_kernel)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of one row (any leading shape of size 1).
    ``config`` = ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` skips autotuning."""
    n, k = weight.shape
    if x.numel() != k or weight.stride(1) != 1:
        raise ValueError("gemv wants one input row and a row-major [N, K] weight")
    xf = x.reshape(k)
    if not xf.is_contiguous():
        xf = xf.contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    args = (xf, weight, bias if bias is not None else y, y, n, k, weight.stride(0))
    if config is None:

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        _gemv_tuned[grid](*args, HAS_BIAS=bias is not None)
    else:
        bn, bk, warps, stages = config
        _gemv_kernel[(triton.cdiv(n, bn),)](
            *args,
            HAS_BIAS=bias is not None,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer should call :func:`gemv` for ``x``."""
    if not (
        HAS_TRITON
        and x.is_cuda
        and x.numel() == x.shape[-1]
        and weight.stride(1) == 1
        and weight.dtype in (torch.float16, torch.bfloat16)
    ):
        return False
    key = (tuple(weight.shape), weight.dtype, weight.device)
    choice = _CHOICE.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return False  # never time inside a capture (shapes are seen eagerly first anyway)
        choice = _CHOICE[key] = _triton_is_faster(x, weight)
    return choice


def _triton_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    import torch.nn.functional as F
    from triton.testing import do_bench_cudagraph

    # Timed as CUDA graphs: decode replays graphs, so launch overhead must not count.
    x = x.reshape(1, -1).contiguous()
    gemv(x, weight)  # autotune outside the capture
    t_cublas = do_bench_cudagraph(lambda: F.linear(x, weight), rep=20)
    t_triton = do_bench_cudagraph(lambda: gemv(x, weight), rep=20)
    return t_triton < t_cublas


_CHOICE: dict = {}
