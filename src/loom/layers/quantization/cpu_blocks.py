"""GGUF block weights multiplied on the CPU by Loom's own kernel (``csrc/block_mm.cpp``).

The kernel takes Q4_0, Q4_1 and Q8_0 weights in one form, per output row: unsigned codes ``u``
and, per block of 32 inputs, an fp16 scale ``d`` and offset ``m`` with ``w = u * d + m`` (the
file's own scales: Q4_1 stores ``d`` and ``m``; Q4_0 is ``m = -8 d``; Q8_0's signed codes are
``u = q + 128`` with ``m = -128 d``). The activations are quantized to int8 in blocks of 32 as
llama.cpp quantizes them, and each block's dot product is exact in int32 (AVX-512 VNNI), so a
4-bit layer keeps its file's 5 bits a weight and a decode step reads just those bytes.

The kernel is compiled the first time it is needed (``loom.layers.cpu_ops``); where it cannot
run, ``available()`` is False and callers keep PyTorch's kernels.
"""

from __future__ import annotations

import functools
import os

import torch

from loom.layers import cpu_ops

BLOCK = 32


@functools.cache
def _build() -> str | None:
    """Compile and load the kernel; the reason it cannot be used, or None."""
    reason = cpu_ops.build(
        "loom_block_mm", os.path.join(os.path.dirname(__file__), "csrc", "block_mm.cpp")
    )
    if reason is not None:
        return reason

    @torch.library.register_fake("loom_cpu::block_mm")
    def _(x, wq, wd, wm, bits):
        return x.new_empty((x.shape[0], wq.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("loom_cpu::block_gemm")
    def _(x, wq, wd, wm, bits):
        return x.new_empty((x.shape[0], wq.shape[0]), dtype=torch.bfloat16)

    @torch.library.register_fake("loom_cpu::block_linear")
    def _(x, wq, wd, wm, bits, gemm_rows):
        return x.new_empty((x.shape[0], wq.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("loom_cpu::block_dequant")
    def _(wq, wd, wm, bits):
        return wq.new_empty((wq.shape[0], wd.shape[1] * BLOCK), dtype=torch.bfloat16)

    return None


def available() -> bool:
    """Whether the kernel runs here (built on first call)."""
    reason = _build()
    if reason is not None:
        cpu_ops.warn_once("GGUF blocks on the CPU", reason)
    return reason is None


# From this many rows a matmul dequantizes the weight to bf16 for oneDNN's GEMM (AMX / AVX-512
# bf16; ``block_gemm``), which outruns the per-row kernel there: on the CPU machine, 3072 x 576
# Q4_1 at 16 rows 0.37 against 0.45 ms, at 64 rows 0.48 against 1.86, at 512 0.97 against 15.2.
GEMM_ROWS = 16


def block_mm(x: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor, wm: torch.Tensor, bits: int):
    """``x [..., k]`` times the block weight's transpose: ``[..., n]`` in ``x``'s dtype."""
    shape = x.shape
    # one op for every batch size: a compiled decode graph then holds no branch on it
    y = torch.ops.loom_cpu.block_linear(x.reshape(-1, shape[-1]), wq, wd, wm, bits, GEMM_ROWS)
    return y.reshape(*shape[:-1], wq.shape[0]).to(x.dtype)


def dequant_reference(wq, wd, wm, bits: int) -> torch.Tensor:
    """``block_dequant`` in plain PyTorch: ``u * d + m`` in fp32, rounded to bf16."""
    u = unpack(wq, wd, wm, bits).float()
    w = u * wd.float()[..., None] + wm.float()[..., None]
    return w.reshape(wq.shape[0], -1).to(torch.bfloat16)


def pack(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int):
    """Codes ``u [n, blocks, 32]`` (uint8), scales and offsets ``[n, blocks]`` as the kernel's
    ``(wq, wd, wm)``: the blocks padded to an even count (zero codes, zero scales), 4-bit codes
    two to a byte (a pair's first block in the low nibbles)."""
    n, blocks = u.shape[:2]
    if blocks % 2:
        u = torch.cat([u, u.new_zeros(n, 1, BLOCK)], dim=1)
        d = torch.cat([d, d.new_zeros(n, 1)], dim=1)
        m = torch.cat([m, m.new_zeros(n, 1)], dim=1)
    if bits == 4:
        wq = (u[:, 0::2] | (u[:, 1::2] << 4)).reshape(n, -1)
    else:
        wq = u.reshape(n, -1)
    return wq.contiguous(), d.to(torch.float16).contiguous(), m.to(torch.float16).contiguous()


# bytes of one block of each GGML type this kernel reads
GGUF_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def gguf_fields(raw: torch.Tensor, qtype: str):
    """A GGUF tensor's raw blocks ``[n, blocks * bytes]`` (uint8) as unsigned codes ``u [n,
    blocks, 32]`` (uint8) and the file's fp16 ``d`` and ``m`` ``[n, blocks]`` with
    ``w = u * d + m``."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, GGUF_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if qtype == "Q8_0":
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return u, d, d * -128
    if qtype == "Q4_1":
        m, qs = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1), b[..., 4:]
    else:
        m, qs = d * -8, b[..., 2:]
    # element j of a GGUF block sits in the low nibble of byte j, element j + 16 in its high one
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1), d, m


def from_gguf(raw: torch.Tensor, qtype: str):
    """A GGUF tensor's raw blocks as the kernel's ``(wq, wd, wm, bits)``; the file's fp16
    scales are kept bit for bit."""
    bits = 8 if qtype == "Q8_0" else 4
    return (*pack(*gguf_fields(raw, qtype), bits), bits)


def quantize_q8_0(w: torch.Tensor):
    """A dense weight ``[n, k]`` in Q8_0 blocks (scale ``max|w| / 127`` in fp16, as GGUF's
    Q8_0 quantizer): ``(wq, wd, wm, 8)``. A weight read from a Q8_0 file comes back as the
    file's blocks."""
    n, k = w.shape
    blocks = -(-k // BLOCK)
    w = torch.nn.functional.pad(w.float(), (0, blocks * BLOCK - k)).reshape(n, blocks, BLOCK)
    d = (w.abs().amax(dim=-1) / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(w * inv[..., None]).clamp(-127, 127)
    u = (q + 128).to(torch.uint8)
    return (*pack(u, d, d * -128, 8), 8)


def unpack(wq: torch.Tensor, wd: torch.Tensor, wm: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's weight as its codes ``[n, blocks, 32]`` (uint8)."""
    n = wq.shape[0]
    if bits == 8:
        return wq.reshape(n, -1, BLOCK)
    pairs = wq.reshape(n, -1, BLOCK)
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=2).reshape(n, -1, BLOCK)


def quantize_activations(x: torch.Tensor, blocks: int):
    """Plain PyTorch's form of the kernel's activation quantization: ``x [rows, k]`` as codes
    ``[rows, blocks, 32]`` (int32), scales ``d`` and ``s = d * sum(codes)`` ``[rows, blocks]``."""
    rows, k = x.shape
    x = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - k)).reshape(rows, blocks, BLOCK)
    amax = x.abs().amax(dim=-1)
    d = amax / 127
    inv = torch.where(amax > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(x * inv[..., None]).to(torch.int32)
    return q, d, d * q.sum(dim=-1).float()


def reference(x: torch.Tensor, wq, wd, wm, bits: int) -> torch.Tensor:
    """The kernel's result in plain PyTorch (float64 sums): ``[rows, n]`` float32."""
    u = unpack(wq, wd, wm, bits).to(torch.int64)
    q, dx, sx = quantize_activations(x, u.shape[1])
    dots = torch.einsum("rbi,nbi->rnb", q.to(torch.int64), u).double()  # exact
    y = (dots * (dx.double()[:, None, :] * wd.double()[None])).sum(-1)
    y += (sx.double()[:, None, :] * wm.double()[None]).sum(-1)
    return y.float()
