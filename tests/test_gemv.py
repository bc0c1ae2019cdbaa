"""Loom's Triton GEMV against ``F.linear`` (CPU under TRITON_INTERPRET=1; CUDA when present)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.layers import gemv as gemv_mod

pytestmark = pytest.mark.skipif(not gemv_mod.HAS_TRITON, reason="triton not installed")


@pytest.mark.parametrize("n,k", [(37, 100), (64, 256), (5, 1030)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for config in [(8, 64, 4, 1), (4, 128, 4, 1)]:
        got = gemv_mod.gemv(x, w, b, config=config)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_gemv_rejects_batches():
    with pytest.raises(ValueError, match="one input row"):
        gemv_mod.gemv(torch.randn(2, 8), torch.randn(4, 8), config=(4, 8, 1, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemv_cuda_autotuned_bf16():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16) / 64
    ref = F.linear(x.float(), w.float())
    torch.testing.assert_close(gemv_mod.gemv(x, w).float(), ref, rtol=2e-2, atol=2e-2)
