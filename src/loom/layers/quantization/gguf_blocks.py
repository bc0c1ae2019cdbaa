"""GGML block layouts of GGUF weights, and their plain-PyTorch dequantiser.

A quantised GGUF tensor stores each row (along the input dimension) as consecutive blocks;
``raw`` is then ``[rows, blocks * bytes_per_block]`` uint8, exactly the file's bytes. All
multi-byte fields are little-endian; ``d``/``m``/``dmin`` are IEEE fp16. Element ``e`` of a
block, by type (``qs``/``ql``/``qh``/``scales`` are byte arrays at the offsets given):

* Q4_0 (32 elements, 18 bytes): ``d`` @0, ``qs[16]`` @2. ``q = e < 16 ? qs[e] & 15 : qs[e-16] >> 4``;
  ``w = d * (q - 8)``.
* Q4_1 (32, 20): ``d`` @0, ``m`` @2, ``qs[16]`` @4. ``q`` as Q4_0; ``w = d * q + m``.
* Q5_0 (32, 22): ``d`` @0, ``qh`` (uint32) @2, ``qs[16]`` @6. ``q = (Q4_0's nibble) | (bit e of
  qh) << 4``; ``w = d * (q - 16)``.
* Q5_1 (32, 24): ``d`` @0, ``m`` @2, ``qh`` @4, ``qs[16]`` @8. ``q`` as Q5_0; ``w = d * q + m``.
* Q8_0 (32, 34): ``d`` @0, ``qs[32]`` (int8) @2. ``w = d * qs[e]``.
* Q4_K (256, 144): ``d`` @0, ``dmin`` @2, ``scales[12]`` @4, ``qs[128]`` @16. Eight sub-blocks
  of 32, ``s = e // 32``, ``l = e % 32``: ``q = qs[32 (s // 2) + l]``'s low nibble for even
  ``s``, high for odd; ``w = (d * sc[s]) * q - dmin * mn[s]`` with 6-bit ``sc``/``mn`` packed
  in ``scales`` (:func:`_k_scale_min`).
* Q5_K (256, 176): ``d`` @0, ``dmin`` @2, ``scales[12]`` @4, ``qh[32]`` @16, ``qs[128]`` @48.
  As Q4_K with ``q |= (bit s of qh[l]) << 4``.
* Q6_K (256, 210): ``ql[128]`` @0, ``qh[64]`` @128, ``scales[16]`` (int8) @192, ``d`` @208.
  Halves of 128, ``h = e // 128``, ``r = e % 128``: ``q = ((ql[64 h + r % 64] >> 4 (r // 64))
  & 15) | (((qh[32 h + r % 32] >> 2 (r // 32)) & 3) << 4)``; ``w = (d * scales[e // 16]) *
  (q - 32)``.

:func:`dequantize_rows` is the reference (bit-exact against the ``gguf`` package's numpy
dequantiser: the same fp32 operations in the same order) and the CPU fallback of
``gguf_triton.gguf_matmul``.
"""

from __future__ import annotations

import torch

QK_K = 256
# GGML type name -> (elements per block, bytes per block)
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def type_name(qtype) -> str:
    """``qtype`` (a name or a ``gguf.GGMLQuantizationType``) as a supported type name."""
    name = getattr(qtype, "name", qtype)
    if name not in BLOCKS:
        raise ValueError(f"unsupported GGML type {name!r} (supported: {', '.join(BLOCKS)})")
    return name


def block_size(qtype) -> int:
    """Elements per block."""
    return BLOCKS[type_name(qtype)][0]


def block_bytes(qtype) -> int:
    """Bytes per block."""
    return BLOCKS[type_name(qtype)][1]


def row_bytes(cols: int, qtype) -> int:
    """Bytes of one row of ``cols`` elements."""
    size, nbytes = BLOCKS[type_name(qtype)]
    if cols % size:
        raise ValueError(f"row length {cols} is not a multiple of {qtype}'s block of {size}")
    return cols // size * nbytes


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte ``off`` of each block of ``b`` ``[..., bytes]``, as fp32 ``[..., 1]``."""
    return b[..., off : off + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``qs`` ``[..., 16]`` as 32 values: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """``qh`` ``[..., 4]`` (a little-endian uint32) as its 32 bits ``[..., 32]``, bit ``e`` at ``e``."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K ``scales`` ``[..., 12]`` as the sub-blocks' 6-bit scales and mins ``[..., 8]``
    (fp32). Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scale ``4+i`` is
    byte ``8+i``'s low nibble with byte ``i``'s top 2 bits above it, min ``4+i`` byte ``8+i``'s
    high nibble with byte ``4+i``'s top 2 bits."""
    s = scales.to(torch.int32)
    lo_d, lo_m, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo_d & 63, (mix & 15) | ((lo_d >> 6) << 4)], dim=-1)
    mn = torch.cat([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def dequantize_rows(raw: torch.Tensor, qtype) -> torch.Tensor:
    """``raw`` ``[rows, blocks * bytes]`` (uint8, GGML blocks of ``qtype``) as fp32
    ``[rows, blocks * elements]``, on ``raw``'s device."""
    name = type_name(qtype)
    size, nbytes = BLOCKS[name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"want uint8 [rows, blocks * {nbytes}] for {name}, got {raw.dtype} "
                         f"{tuple(raw.shape)}")  # fmt: skip
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, nbytes)  # [rows, blocks, bytes]
    if name == "Q4_0":
        q = _nibbles(b[..., 2:18]).to(torch.int32) - 8
        w = _f16(b, 0) * q.float()
    elif name == "Q4_1":
        w = _f16(b, 0) * _nibbles(b[..., 4:20]).float() + _f16(b, 2)
    elif name == "Q5_0":
        q = (_nibbles(b[..., 6:22]) | (_high_bits32(b[..., 2:6]) << 4)).to(torch.int32) - 16
        w = _f16(b, 0) * q.float()
    elif name == "Q5_1":
        q = _nibbles(b[..., 8:24]) | (_high_bits32(b[..., 4:8]) << 4)
        w = _f16(b, 0) * q.float() + _f16(b, 2)
    elif name == "Q8_0":
        w = b[..., 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)
    elif name in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[..., 4:16])
        d = (_f16(b, 0) * sc)[..., None]  # [rows, blocks, 8, 1]
        dm = (_f16(b, 2) * mn)[..., None]
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        # byte 32 c + l: sub-block 2c's element l (low nibble), 2c+1's (high nibble)
        qs = qs.reshape(rows, -1, 4, 1, 32)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(rows, -1, 8, 32)
        if name == "Q5_K":
            shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)[:, None]
            qh = b[..., 16:48][..., None, :]  # [rows, blocks, 1, 32]
            q = q | (((qh >> shifts) & 1) << 4)
        w = d * q.float() - dm
    else:  # Q6_K
        ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(rows, -1, 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], device=raw.device, dtype=torch.uint8)[:, None]
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        qh = ((qh >> shifts) & 3).reshape(rows, -1, 8, 32)
        q = (ql | (qh << 4)).to(torch.int32) - 32
        scales = b[..., 192:208].contiguous().view(torch.int8).float()
        d = (_f16(b, 208) * scales)[..., None]  # [rows, blocks, 16, 1]
        w = d * q.reshape(rows, -1, 16, 16).float()
    return w.reshape(rows, -1)
