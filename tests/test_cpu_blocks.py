"""Loom's CPU kernel for GGUF blocks (``layers/quantization/csrc/block_mm.cpp``).

Oracles: the ``gguf`` package's quantizer and dequantizer (the blocks the kernel's form holds),
and plain PyTorch's form of the kernel's arithmetic (``cpu_blocks.reference``: the activations
quantized to int8 in blocks of 32, exact integer dot products, the sums in float64), which the
kernel must equal up to float32 rounding of its sums."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from loom.layers.quantization import cpu_blocks

pytestmark = pytest.mark.skipif(
    not cpu_blocks.available(), reason=f"Loom's CPU block kernel: {cpu_blocks._build()}"
)


def _gguf(qtype: str, rows: int, cols: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(w, kind)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, kind))


def _random(bits: int, n: int, blocks: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16 if bits == 4 else 256, (n, blocks, 32), dtype=torch.uint8, generator=g)
    d = torch.rand(n, blocks, generator=g) * 0.02 + 1e-3
    m = torch.randn(n, blocks, generator=g) * 0.01
    return cpu_blocks.pack(u, d, m, bits)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_hold_the_files_weights(qtype):
    """``u * d + m`` of the kernel's form equals the gguf package's dequantisation bit for bit
    (an odd number of blocks: the padding block adds nothing)."""
    raw, want = _gguf(qtype, 24, 5 * 32)
    wq, wd, wm, bits = cpu_blocks.from_gguf(raw, qtype)
    assert wd.shape == (24, 6)  # 5 blocks and one of padding
    u = cpu_blocks.unpack(wq, wd, wm, bits).float()
    got = (u * wd.float()[..., None] + wm.float()[..., None]).reshape(24, -1)
    assert torch.equal(got[:, : 5 * 32], want)
    assert not got[:, 5 * 32 :].any()


def test_a_q8_0_weight_requantizes_to_its_files_blocks():
    raw, dense = _gguf("Q8_0", 40, 96, seed=3)
    got, want = cpu_blocks.quantize_q8_0(dense), cpu_blocks.from_gguf(raw, "Q8_0")
    assert got[3] == want[3] == 8
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_plain_pytorch_form(bits, rows, dtype):
    """Rows below ``GEMM_ROWS`` go through the per-row kernel: tiles of 4 rows and the rest one
    by one, inputs not a multiple of 64 (the last pair half padding)."""
    n, k = 70, 3 * 32 + 20
    wq, wd, wm = _random(bits, n, 4, seed=rows)
    x = torch.randn(rows, k).to(dtype)
    got = torch.ops.loom_cpu.block_mm(x, wq, wd, wm, bits)
    want = cpu_blocks.reference(x, wq, wd, wm, bits)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_activation_codes_round_half_to_even():
    """The kernel's codes, read back through an identity weight: with max|x| = 127 the scale is
    1 and x = j + 0.5 lies exactly between two codes."""
    x = torch.arange(32, dtype=torch.float32) + 0.5
    x[-1] = 127.0
    eye = torch.eye(32, dtype=torch.uint8)[:, None, :]  # [32 rows, 1 block, 32]
    wq, wd, wm = cpu_blocks.pack(eye, torch.ones(32, 1), torch.zeros(32, 1), 8)
    got = torch.ops.loom_cpu.block_mm(x[None], wq, wd, wm, 8)[0]
    assert got[:5].tolist() == [0.0, 2.0, 2.0, 4.0, 4.0] and got[-1] == 127.0
    q, _, _ = cpu_blocks.quantize_activations(x[None], 1)
    assert torch.equal(got, q[0, 0].float())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [cpu_blocks.GEMM_ROWS + 3, 130])
def test_large_batches_dequantize_for_the_gemm(bits, rows):
    """From ``GEMM_ROWS`` rows the weight is dequantized to bf16 (exactly ``u * d + m`` in fp32,
    rounded to nearest even) for a bf16 GEMM, in chunks of ~1 MB of weight rows below 128 rows
    (3,000 rows of 192 inputs: two chunks) and whole from 128: within bf16's rounding of the
    dense product."""
    wq, wd, wm = _random(bits, 3000, 6, seed=bits)
    dense = cpu_blocks.dequant_reference(wq, wd, wm, bits)
    assert torch.equal(torch.ops.loom_cpu.block_dequant(wq, wd, wm, bits), dense)
    x = torch.randn(rows, 6 * 32 - 8)
    got = cpu_blocks.block_mm(x, wq, wd, wm, bits)
    want = x @ dense.float()[:, : x.shape[1]].T
    assert got.dtype == torch.float32 and got.shape == (rows, 3000)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


def test_kernel_matches_the_dense_weight_within_int8_activation_error():
    """Against the fp32 matmul over the gguf package's dequantised Q4_1 weight: the only
    difference is the activations' int8 codes, each within half a step (max|x_block| / 254)."""
    raw, dense = _gguf("Q4_1", 64, 576, seed=5)
    wq, wd, wm, bits = cpu_blocks.from_gguf(raw, "Q4_1")
    x = torch.randn(2, 576)
    got = cpu_blocks.block_mm(x, wq, wd, wm, bits)
    want = x @ dense.T
    xb = x.reshape(2, -1, 32).abs().amax(-1) / 254  # [rows, blocks]
    bound = (xb[:, None, :] * dense.abs().reshape(64, -1, 32).sum(-1)[None]).sum(-1)
    assert ((got - want).abs() <= bound * 1.001 + 1e-6).all()


def test_kernel_runs_inside_a_compiled_graph():
    """The op's fake implementation lets torch.compile trace it (the compiled decode step), and
    one graph traced at 3 rows serves batches on both sides of ``GEMM_ROWS``: the per-row kernel
    and the GEMM are one op, so no guard on the batch size recompiles mid-serving."""
    from torch._dynamo.utils import counters

    wq, wd, wm = _random(4, 32, 4)  # (sizes unlike the rows': Dynamo would equate them)

    def f(x):
        return torch.relu(cpu_blocks.block_mm(x * 2, wq, wd, wm, 4)) + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (3, 5, cpu_blocks.GEMM_ROWS + 7):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(compiled(x), f(x))
    assert counters["stats"]["unique_graphs"] == 1
