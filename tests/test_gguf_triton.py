"""GGUF blocks kept raw: the plain-PyTorch dequantiser against the ``gguf`` package's numpy one
(bit-exact), and the Triton matmul/dequant kernels against it (on CPU under TRITON_INTERPRET=1
at tiny shapes, on CUDA when present; real shapes in the ``gpu`` tests)."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (as tests/conftest.py
# sets it; repeated here for runs of this file alone, before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loom.layers.quantization import gguf_triton  # noqa: E402
from loom.layers.quantization.gguf_blocks import BLOCKS, dequantize_rows  # noqa: E402

try:
    import gguf
except ImportError:  # (the GPU machine's image has no gguf package: the oracle tests skip)
    gguf = None

TYPES = list(BLOCKS)
# types the gguf package can quantise (the K-quants it only dequantises)
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# byte offsets of each block's fp16 fields (d, and m / dmin)
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
# the fp16 fields' magnitude, so that weights come out around 0.01-0.1 as in real models
FP16_SCALE = {"Q8_0": 1e-3, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 1e-4}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

needs_gguf = pytest.mark.skipif(gguf is None, reason="gguf not installed")
needs_triton = pytest.mark.skipif(not gguf_triton.HAS_TRITON, reason="triton not installed")


def random_blocks(rows: int, cols: int, name: str, seed: int, device="cpu") -> torch.Tensor:
    """Valid random blocks ``[rows, cols / block * bytes]``: any bytes are valid quants, scale
    bytes and high bits; only the fp16 fields are overwritten with finite values."""
    size, nbytes = BLOCKS[name]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols // size, nbytes), generator=gen, dtype=torch.uint8)
    for off in FP16_FIELDS[name]:
        v = (torch.rand(rows, cols // size, 1, generator=gen) * 2 - 1) * FP16_SCALE.get(name, 1e-2)
        raw[..., off : off + 2] = v.to(torch.float16).view(torch.uint8)
    return raw.reshape(rows, -1).to(device)


def quantized_blocks(rows: int, cols: int, name: str, seed: int):
    """Blocks made by gguf's quantiser from Gaussian weights."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=gen) * 0.05).numpy()
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[name]).copy())


def reference(raw: torch.Tensor, name: str) -> torch.Tensor:
    return torch.from_numpy(
        gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]).copy()
    )


# byte ranges of each block's quants (the rest: fp16 fields, K-quant sub-block scales)
QUANT_BYTES = {
    "Q4_0": (2, 18),
    "Q4_1": (4, 20),
    "Q5_0": (2, 22),
    "Q5_1": (4, 24),
    "Q8_0": (2, 34),
    "Q4_K": (16, 144),
    "Q5_K": (16, 176),
    "Q6_K": (0, 192),
}


def offsets(raw: torch.Tensor, name: str) -> torch.Tensor:
    """Each weight's offset ``b`` in ``w = a q + b`` (the weight of quant 0)."""
    size, nbytes = BLOCKS[name]
    lo, hi = QUANT_BYTES[name]
    zeroed = raw.reshape(raw.shape[0], -1, nbytes).clone()
    zeroed[..., lo:hi] = 0
    return dequantize_rows(zeroed.reshape(raw.shape), name)


def accumulation_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per output, a bound on how far two fp32 evaluations of ``sum_k x[t, k] w[n, k]`` can
    differ: the reference sums the products in some order, the kernel computes each block as
    ``a sum q x + b sum x`` (``w = a q + b``). Each is within ``K u sum_k |x| (|a q| + |b|)`` of
    the exact sum (u = 2^-24, to first order), and ``|a q| + |b| <= |w| + 2 |b|``."""
    k = x.shape[-1]
    return 2 * k * 2.0**-24 * (x.abs().float() @ (w.abs() + 2 * b.abs()).T) + 1e-30


# ---- (a) dequantize_rows against gguf's numpy dequantiser (CPU, no Triton) ------------------


@needs_gguf
@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows_equals_gguf_on_random_blocks(name):
    raw = random_blocks(6, 2 * 256, name, seed=1)
    got = dequantize_rows(raw, name)
    want = reference(raw, name)
    assert got.shape == want.shape == (6, 512)
    assert torch.equal(got, want)


@needs_gguf
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantize_rows_equals_gguf_on_quantized_weights(name):
    raw = quantized_blocks(5, 96, name, seed=2)
    assert raw.shape == (5, 96 // BLOCKS[name][0] * BLOCKS[name][1])
    assert torch.equal(dequantize_rows(raw, name), reference(raw, name))


def test_dequantize_rows_accepts_gguf_enum_and_rejects_bad_shapes():
    raw = random_blocks(2, 64, "Q4_0", seed=3)
    if gguf is not None:
        assert torch.equal(
            dequantize_rows(raw, gguf.GGMLQuantizationType.Q4_0), dequantize_rows(raw, "Q4_0")
        )
    with pytest.raises(ValueError, match="unsupported"):
        dequantize_rows(raw, "Q2_K")
    with pytest.raises(ValueError, match="uint8"):
        dequantize_rows(raw[:, :-1], "Q4_0")


# ---- (b) the Triton kernels at tiny shapes (interpreter on CPU) -----------------------------


@needs_triton
@pytest.mark.parametrize("name", TYPES)
def test_dequant_kernel_equals_reference(name):
    raw = random_blocks(9, 512, name, seed=4, device=DEVICE)
    want = dequantize_rows(raw, name)
    got = gguf_triton.gguf_dequantize(raw, name, block_n=4)
    # the kernel computes a * q + b (rounding a q by u |a q| <= u (|w| + |b|), then the sum by
    # u |w|; an FMA only the sum), the reference as gguf does (e.g. Q6_K's a * (q - 32))
    bound = 2.0**-22 * (want.abs() + offsets(raw, name).abs())
    assert ((got - want).abs() <= bound).all()


@needs_triton
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("t", [1, 3])
def test_gemv_kernel_matches_reference(name, t):
    # K=512: two superblocks of the K-quants, 16 blocks of the others; N=20: a partial tile
    n, k = 20, 512
    raw = random_blocks(n, k, name, seed=5 + t, device=DEVICE)
    w = dequantize_rows(raw, name)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    want = x @ w.T
    # two K iterations per row (fewer groups per iteration than the row has), a partial
    # BLOCK_T slice when t = 3
    g = 4 if name.endswith("_K") else 8
    got = gguf_triton.gguf_matmul(x, raw, name, config=(2 if t > 1 else 1, 8, g, 4))
    assert got.shape == (t, n) and got.dtype == x.dtype
    assert ((got - want).abs() <= accumulation_bound(x, w, offsets(raw, name))).all()


@needs_triton
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_gemv_default_config_leading_dims_and_bf16(name):
    n, k = 8, 256
    raw = random_blocks(n, k, name, seed=7, device=DEVICE)
    w = dequantize_rows(raw, name)
    x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    got = gguf_triton.gguf_matmul(x.to(torch.bfloat16), raw, name)
    assert got.shape == (1, 1, n) and got.dtype == torch.bfloat16
    xb = x.to(torch.bfloat16).float()
    want = xb @ w.T
    # fp32 accumulation, then one conversion to bf16 (8 significant bits): 2^-8 relative when
    # rounded to nearest (a GPU), 2^-7 when truncated (Triton's interpreter)
    bound = accumulation_bound(xb, w, offsets(raw, name)) + 2.0**-7 * want.abs()
    assert ((got.float() - want).abs() <= bound).all()


@needs_triton
def test_many_rows_dequantize_then_matmul():
    """Above GEMV_MAX_T rows: dequantised by the Triton kernel, multiplied by torch.matmul."""
    n, k, t = 12, 256, gguf_triton.GEMV_MAX_T + 1
    raw = random_blocks(n, k, "Q6_K", seed=8, device=DEVICE)
    w = dequantize_rows(raw, "Q6_K")
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    got = gguf_triton.gguf_matmul(x, raw, "Q6_K")
    assert ((got - x @ w.T).abs() <= accumulation_bound(x, w, offsets(raw, "Q6_K"))).all()


def test_gguf_matmul_rejects_mismatched_blocks():
    raw = random_blocks(4, 64, "Q4_0", seed=9)
    with pytest.raises(ValueError, match="uint8"):
        gguf_triton.gguf_matmul(torch.randn(1, 96), raw, "Q4_0")


# ---- (c) real shapes on CUDA -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("t", [1, 16, 128])
def test_cuda_real_shapes(name, t):
    n = k = 4096
    raw = random_blocks(n, k, name, seed=10, device="cuda")
    w = dequantize_rows(raw, name)
    x = torch.randn(t, k, device="cuda", generator=torch.Generator("cuda").manual_seed(t))
    xb = x.to(torch.bfloat16)
    got = gguf_triton.gguf_matmul(xb, raw, name).float()
    want = xb.float() @ w.T
    mag = xb.float().abs() @ w.abs().T
    if t <= gguf_triton.GEMV_MAX_T:
        # in-kernel fp32 accumulation, then one bf16 rounding of the output (2^-8 relative)
        bound = accumulation_bound(xb.float(), w, offsets(raw, name)) + 2.0**-8 * want.abs()
    else:
        # the weights rounded to bf16 (2^-8 relative each), cuBLAS's fp32 accumulation, and
        # the output's bf16 rounding
        bound = (
            2.0**-8 * mag
            + accumulation_bound(xb.float(), w, offsets(raw, name))
            + 2.0**-8 * want.abs()
        )
    assert ((got - want).abs() <= bound).all()


def test_model_layers_keep_the_files_blocks_and_match_the_dequantized_file(tmp_path, monkeypatch):
    """``--quantization gguf`` with the blocks kept (as on CUDA; here the Triton interpreter
    runs the kernels on the CPU): a GGUF whose projections are Q4_0, Q8_0, Q5_0 and Q4_1 loads
    each packed layer as its parts' raw rows, and every layer computes what the same file's
    dense layer (dequantized at load) computes, within fp32 summation order."""
    from transformers import AutoModelForCausalLM

    from loom.layers.quantization import gguf as gguf_method
    from loom.testing import check_quantization
    from loom.testing.gguf_writer import bpe_vocab, write_gguf
    from loom.testing.model import tiny_config
    from tests.gpu.test_cuda_quantization import GGUF_TYPES

    vocab = bpe_vocab()
    config = tiny_config("LlamaForCausalLM", vocab_size=len(vocab.tokens), hidden_size=128,
                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, "llama", model, vocab, quant=GGUF_TYPES)
    monkeypatch.setattr(gguf_method, "keeps_blocks", lambda: True)
    assert check_quantization("gguf", path, rtol=1e-4, min_layers=8) == 8
