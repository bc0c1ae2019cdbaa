"""fp8's Triton kernels: the weight-only GEMV against fp32 PyTorch on the dequantized weights,
the per-token activation quantization bit for bit against the five-op PyTorch reference, and
``Fp8LinearMethod.apply``'s dispatch to them (on CPU under TRITON_INTERPRET=1 at tiny shapes; on
CUDA at Llama-3-8B shapes, and inside a CUDA graph, in the ``gpu`` tests)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (as tests/conftest.py
# sets it; repeated here for runs of this file alone, before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loom.layers.quantization import fp8 as fp8_method  # noqa: E402
from loom.layers.quantization import fp8_triton  # noqa: E402
from loom.layers.quantization.fp8_triton import FP8, TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not fp8_triton.HAS_TRITON, reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fp8_weights(n: int, k: int, seed: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 rows and per-row scales as ``quantize_rows`` makes them from Gaussian weights."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    q, scale = fp8_method.quantize_rows(w)
    return q.to(device), scale.to(device)


def randn(*shape: int, seed: int, dtype=torch.bfloat16, device=DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w.float() * scale.float()[:, None]


def gemv_bound(x: torch.Tensor, wd: torch.Tensor, want: torch.Tensor, out_ulp: float):
    """How far the kernel's output may be from ``want`` (fp32 sums of ``x @ wd.T``): two fp32
    summations of K products in different orders (the kernel's per-thread partials, tree
    reductions, split-K slices; the reference's ``w * scale`` rounded per element, the kernel's
    scale applied once per output) each within ``(K + 1) u sum |x w|`` of the exact sum
    (u = 2^-24, first order), then one rounding of the output to bf16 / fp16: ``out_ulp``
    relative (2^-8 for bf16 rounded to nearest on a GPU, 2^-7 in Triton's interpreter, which
    truncates; 2^-11 / 2^-10 for fp16)."""
    k = x.shape[-1]
    mag = x.float().abs() @ wd.abs().T
    accum = 2 * (k + 1) * 2.0**-24 * mag
    return accum + out_ulp * (want.abs() + accum) + 1e-30


def scaled_mm_bound(xd: torch.Tensor, wd: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` of E4M3 rows ``xd`` and ``wd`` (dequantized) against fp32 sums: cuBLAS's
    FP8 GEMM accumulates in the tensor cores at reduced precision between its promotions to
    fp32, so a looser 2^-10 of the products' magnitude, plus the output's bf16 rounding (2^-7
    covers truncation as well as rounding to nearest)."""
    return 2.0**-10 * (xd.abs() @ wd.abs().T) + 2.0**-7 * want.abs() + 1e-30


def out_ulp(dtype: torch.dtype, device: str) -> float:
    bits = 8 if dtype == torch.bfloat16 else 11  # significand bits, the implicit one included
    return 2.0 ** -(bits - 1 if device == "cpu" else bits)


# ---- the GEMV at tiny shapes -------------------------------------------------------------


# N = 37 and K = 200: partial tiles along both; block_k 64 < K: several iterations, the last
# one masked; split_k 2-3: the partials' sum (its last slice shorter, or empty).
CONFIGS = [None, TileConfig(2, 64), TileConfig(4, 64, split_k=3), TileConfig(1, 16, 2, 1, 1)]


@needs_triton
@pytest.mark.parametrize("config", CONFIGS)
def test_gemv_matches_fp32_reference(config):
    n, k = 37, 200
    w, scale = fp8_weights(n, k, seed=1)
    x = randn(1, k, seed=11)
    got = fp8_triton.fp8_gemv(x, w, scale, config=config)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    wd = dequantized(w, scale)
    want = x.float() @ wd.T
    assert ((got.float() - want).abs() <= gemv_bound(x, wd, want, out_ulp(x.dtype, DEVICE))).all()


@needs_triton
def test_gemv_and_skinny_bias_fp16_and_leading_dims():
    """The bias is added in fp32 before the one rounding (split-K: by the summing kernel)."""
    n, k = 24, 96
    w, scale = fp8_weights(n, k, seed=20)
    bias = randn(n, seed=22, dtype=torch.float16)
    wd = dequantized(w, scale)
    x = randn(1, 1, k, seed=21, dtype=torch.float16)
    want = x.float() @ wd.T + bias.float()
    for config in (None, TileConfig(4, 32, split_k=2)):
        got = fp8_triton.fp8_gemv(x, w, scale, bias, config=config)
        assert got.shape == (1, 1, n) and got.dtype == torch.float16
        bound = gemv_bound(x, wd, want, out_ulp(x.dtype, DEVICE)) + 2.0**-24 * bias.float().abs()
        assert ((got.float() - want).abs() <= bound).all()
    x = randn(1, 5, k, seed=23, dtype=torch.float16)
    for config in (None, TileConfig(64, 32, 2, 4, 2)):
        got = fp8_triton.fp8_skinny(x, w, scale, bias, config=config)
        assert got.shape == (1, 5, n) and got.dtype == torch.float16
        block = (config or fp8_triton.skinny_config(5, n, k)).block_k
        ref = fp8_triton.skinny_reference(x.reshape(5, k), w, scale, block) + bias.float()
        bound = skinny_bound(x.reshape(5, k), wd, ref, DEVICE) + 2.0**-24 * bias.float().abs()
        assert ((got.reshape(5, n).float() - ref).abs() <= bound).all()


def test_launch_configs_fill_the_sms():
    """On an H200's 132 SMs: the 8B shapes give the GEMV enough programs by N alone (no
    split-K, so one launch), and the skinny kernel splits K where its 128-row tiles are few;
    small N splits, a K of one block never does."""
    sms = 132
    shapes = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
    for n, k in shapes:
        c = fp8_triton.gemv_config(n, k, sms)
        assert c.split_k == 1 and -(-n // c.block_n) >= 2 * sms
        s = fp8_triton.skinny_config(4, n, k, sms)
        assert -(-n // s.block_n) * s.split_k >= 2 * sms
    assert fp8_triton.gemv_config(256, 4096, sms).split_k > 1
    assert fp8_triton.gemv_config(40, 100, sms).split_k == 1


def test_gemv_rejects_bad_inputs():
    w, scale = fp8_weights(8, 32, seed=0, device="cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_triton.fp8_gemv(torch.randn(1, 48, dtype=torch.bfloat16), w, scale)
    with pytest.raises(ValueError, match="bf16 / fp16"):
        fp8_triton.fp8_gemv(torch.randn(1, 32), w, scale)
    with pytest.raises(ValueError, match="one row, got 2"):
        fp8_triton.fp8_gemv(torch.randn(2, 32, dtype=torch.bfloat16), w, scale)
    with pytest.raises(ValueError, match="at most 16 rows"):
        fp8_triton.fp8_skinny(torch.randn(17, 32, dtype=torch.bfloat16), w, scale)


# ---- the activation quantization, bit for bit ----------------------------------------------


def assert_same_quantization(x2: torch.Tensor) -> None:
    q, s = fp8_triton.quantize_per_token(x2)
    q_ref, s_ref = fp8_triton._quantize_per_token_torch(x2)
    assert q.dtype == FP8 and q.shape == x2.shape and s.shape == (x2.shape[0], 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_per_token_is_the_reference_bit_for_bit(dtype):
    # rows spanning 12 decades (fp16's range clips the ends: those rows saturate or vanish)
    x = torch.randn(48, 1000, generator=torch.Generator().manual_seed(1))
    x = x * torch.logspace(-8, 4, 48)[:, None]
    x[3] = 0.0  # the 1e-12 floor of the scale
    x[4, ::2] = -0.0  # the sign of zero
    x[5] = x[5] * 1e-4
    x[5, 0] = 300.0  # one outlier: the rest of its row lands on E4M3 subnormals
    assert_same_quantization(x.to(DEVICE, dtype))


@needs_triton
def test_quantize_per_token_rounds_ties_to_even():
    """Every midpoint between neighbouring E4M3 values, at scale 1 (absmax 448)."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    mids = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([mids, -mids, torch.tensor([448.0])])
    assert_same_quantization(row[None].repeat(2, 1).to(DEVICE))


@needs_triton
def test_quantize_per_token_two_passes_over_long_rows():
    k = fp8_triton.QUANT_BLOCK + 1000  # longer than one block: absmax pass, then quantize pass
    assert_same_quantization(randn(2, k, seed=3) * 5)


# ---- Fp8LinearMethod.apply's dispatch (the layer's flag set as on an FP8 GPU) ---------------


def fp8_layer(n: int, k: int, seed: int, device=DEVICE):
    w, scale = fp8_weights(n, k, seed, device)
    return SimpleNamespace(weight_fp8=w, weight_scale=scale, fp8_matmul=True)


def skinny_bound(x, wd, want, device):
    """``fp8_skinny`` against ``skinny_reference`` (the same E4M3 activations and block scales
    in fp32): in the interpreter fp32 dots in another order, as for the GEMV; on a GPU the FP8
    tensor cores accumulate a block at reduced precision before its promotion to fp32, as
    cuBLAS's FP8 GEMM does (``scaled_mm_bound``)."""
    if device == "cpu":
        return gemv_bound(x, wd, want, out_ulp(x.dtype, device))
    return scaled_mm_bound(x.float(), wd, want)


@needs_triton
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (2, 200, 300, TileConfig(64, 64, 1, 4, 2)),  # partial tiles, masked K
        (5, 130, 256, TileConfig(64, 128, 2, 4, 2)),  # split-K
        (16, 64, 96, None),  # the default launch, a full 16-row tile
    ],
)
def test_skinny_matches_its_reference(m, n, k, config):
    w, scale = fp8_weights(n, k, seed=n)
    x = randn(m, k, seed=m)
    x[0, :5] *= 50  # an outlier block: its own scale
    got = fp8_triton.fp8_skinny(x, w, scale, config=config).float()
    block = (config or fp8_triton.skinny_config(m, n, k)).block_k
    want = fp8_triton.skinny_reference(x, w, scale, block)
    wd = dequantized(w, scale)
    assert ((got - want).abs() <= skinny_bound(x, wd, want, DEVICE)).all()
    full = x.float() @ wd.T  # and it is x @ W.T within E4M3's rounding of the activations
    assert (got - full).abs().max() <= 2.0**-4 * (x.float().abs() @ wd.abs().T).max()


@needs_triton
def test_apply_routes_few_rows_to_the_gemv_and_the_skinny_kernel(monkeypatch):
    """One bf16 / fp16 row: the GEMV (weights only quantized); 2 to SKINNY_MAX_M: the skinny
    FP8 kernel; fp32 rows: the dequantized matmul, as on the CPU."""
    calls = []
    gemv, skinny = fp8_method.fp8_gemv, fp8_method.fp8_skinny
    monkeypatch.setattr(fp8_method, "fp8_gemv", lambda *a: calls.append("gemv") or gemv(*a))
    monkeypatch.setattr(fp8_method, "fp8_skinny", lambda *a: calls.append("sk") or skinny(*a))
    layer = fp8_layer(20, 64, seed=4)
    wd = dequantized(layer.weight_fp8, layer.weight_scale)
    bias = randn(20, seed=5)
    method = fp8_method.Fp8LinearMethod()
    for m in (1, 2, fp8_triton.SKINNY_MAX_M):
        x = randn(m, 1, 64, seed=m)
        got = method.apply(layer, x, bias)
        assert got.shape == (m, 1, 20)
        assert calls[-1] == ("gemv" if m == 1 else "sk")
        if m == 1:
            want = x.float() @ wd.T + bias.float()
            bound = gemv_bound(x, wd, want, out_ulp(x.dtype, DEVICE))
        else:
            x2 = x.reshape(m, 64)
            block = fp8_triton.skinny_config(m, 20, 64).block_k
            ref = fp8_triton.skinny_reference(x2, layer.weight_fp8, layer.weight_scale, block)
            want = (ref.to(x.dtype).float() + bias.float()).reshape(m, 1, 20)
            bound = skinny_bound(x2, wd, ref, DEVICE).reshape(m, 1, 20) + 2.0**-7 * want.abs()
        assert ((got.float() - want).abs() <= bound + 2.0**-24 * bias.float().abs()).all()
    x = randn(2, 64, seed=6, dtype=torch.float32)
    got = method.apply(layer, x, None)
    assert len(calls) == 3 and got.dtype == torch.float32
    assert torch.allclose(got, x @ wd.T, rtol=1e-5, atol=1e-6)


@needs_triton
def test_apply_quantizes_more_rows_for_scaled_mm():
    """Past SKINNY_MAX_M bf16 rows: the fused quantization's E4M3 rows and scales into
    ``torch._scaled_mm`` (on the CPU too, where PyTorch has it)."""
    layer = fp8_layer(20, 64, seed=7)
    x = randn(fp8_triton.SKINNY_MAX_M + 4, 64, seed=8)
    try:
        got = fp8_method.Fp8LinearMethod().apply(layer, x, None)
    except (RuntimeError, NotImplementedError) as e:  # (a PyTorch without CPU _scaled_mm)
        pytest.skip(f"torch._scaled_mm: {e}")
    q, s = fp8_triton._quantize_per_token_torch(x)
    xd = q.float() * s
    wd = dequantized(layer.weight_fp8, layer.weight_scale)
    want = xd @ wd.T
    assert ((got.float() - want).abs() <= scaled_mm_bound(xd, wd, want)).all()


# ---- CUDA: real shapes, the wired method, graphs ---------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (512, 4096)])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 64])
def test_cuda_apply_matches_the_dequantized_reference(n, k, m):
    """A layer quantized at load on an FP8 GPU: one row through the GEMV, up to 16 through the
    skinny kernel, more through the fused quantization and ``_scaled_mm``, each within its own
    numbers' rounding."""
    if not fp8_method.fp8_matmul_supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(randn(n, k, seed=n + k) / k**0.5, requires_grad=False)
    method = fp8_method.Fp8LinearMethod()
    method.process_weights_after_loading(layer)
    assert layer.fp8_matmul
    wd = dequantized(layer.weight_fp8, layer.weight_scale)
    x = randn(m, k, seed=m)
    got = method.apply(layer, x, None).float()
    if m == 1:
        want = x.float() @ wd.T
        bound = gemv_bound(x, wd, want, 2.0**-8)
    elif m <= fp8_triton.SKINNY_MAX_M:
        block = fp8_triton.skinny_config(m, n, k).block_k
        want = fp8_triton.skinny_reference(x, layer.weight_fp8, layer.weight_scale, block)
        bound = skinny_bound(x, wd, want, "cuda")
    else:
        assert_same_quantization(x)
        q, s = fp8_triton.quantize_per_token(x)
        xd = q.float() * s
        want = xd @ wd.T
        bound = scaled_mm_bound(xd, wd, want)
    assert ((got - want).abs() <= bound).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1])
def test_cuda_gemv_replays_in_a_graph(m):
    """Captured once (N = 4096: one kernel), replayed on new inputs: bit-equal to eager calls
    (no host-side state, a fixed summation order)."""
    if not fp8_method.fp8_matmul_supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    w, scale = fp8_weights(4096, 4096, seed=9)
    x = randn(m, 4096, seed=10)
    fp8_triton.fp8_gemv(x, w, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_triton.fp8_gemv(x, w, scale)
    for seed in (11, 12):
        x.copy_(randn(m, 4096, seed=seed))
        graph.replay()
        assert torch.equal(y, fp8_triton.fp8_gemv(x, w, scale))


@pytest.mark.gpu
@needs_cuda
def test_cuda_skinny_replays_in_a_graph():
    """The skinny kernel at 4 rows (split-K and its sum at N = 4096), captured once and
    replayed on new inputs: bit-equal to eager calls."""
    if not fp8_method.fp8_matmul_supported(torch.device("cuda")):
        pytest.skip("needs compute capability 8.9+")
    w, scale = fp8_weights(4096, 4096, seed=9)
    x = randn(4, 4096, seed=10)
    fp8_triton.fp8_skinny(x, w, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_triton.fp8_skinny(x, w, scale)
    for seed in (11, 12):
        x.copy_(randn(4, 4096, seed=seed))
        graph.replay()
        assert torch.equal(y, fp8_triton.fp8_skinny(x, w, scale))
