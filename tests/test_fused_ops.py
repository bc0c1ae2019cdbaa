"""Fused Triton kernels against the layers' plain-PyTorch paths (CPU: Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from loom.layers import fused_ops
from loom.layers.activation import SiluAndMul
from loom.layers.layernorm import RMSNorm
from loom.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not fused_ops.HAS_TRITON, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(dtype, with_residual):
    torch.manual_seed(0)
    weight = torch.randn(96, device=DEVICE).to(dtype)
    x = torch.randn(7, 96, device=DEVICE, dtype=dtype)
    r = torch.randn(7, 96, device=DEVICE, dtype=dtype) if with_residual else None
    h = x + r if with_residual else x  # HF's order of operations, as RMSNorm's torch path
    hf = h.float()
    want = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = fused_ops.add_rmsnorm(x, r, weight, 1e-5)
    if with_residual:
        got, res = got
        torch.testing.assert_close(res, h)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if not x.is_cuda:  # the layer's own path on CPU is the same formula
        norm = RMSNorm(96, eps=1e-5).to(dtype)
        norm.weight.data = weight
        layer = norm(x, r)
        torch.testing.assert_close((layer[0] if with_residual else layer), want)


# (q heads, k heads, tokens): one head per program (few tokens), then groups of 2 and of 3 heads
# (a group size that is not a power of two: its tile is masked)
_ROTARY_SHAPES = [(4, 2, 9), (4, 2, 80), (9, 3, 70)]


def test_rotary_heads_per_program():
    assert fused_ops.rotary_heads_per_program(1, 32, 8) == 1  # decode: one head a program
    assert fused_ops.rotary_heads_per_program(8192, 32, 8) == 8
    assert fused_ops.rotary_heads_per_program(8192, 9, 3) == 3
    assert fused_ops.rotary_heads_per_program(100, 28, 4) == 4
    assert fused_ops.rotary_heads_per_program(100, 40, 40) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,t", _ROTARY_SHAPES)
def test_rotary_inplace_on_qkv_slices(dtype, hq, hk, t):
    torch.manual_seed(0)
    head_dim = 32
    rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEVICE, dtype=dtype)
    q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim : (hq + hk) * head_dim]
    positions = torch.randint(0, 64, (t,), device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    fused_ops.rotary_inplace(q, k, cos, sin, head_dim)
    torch.testing.assert_close(q.float(), want_q.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k.float(), want_k.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,t", _ROTARY_SHAPES)
def test_rotary_store_writes_kv_cache(dtype, hq, hk, t):
    """The fused KV store: q rotated in place, rotated k and plain v land in the cache rows at
    ``loc`` (other rows untouched), k itself is left alone."""
    torch.manual_seed(0)
    head_dim, slots = 32, 2 * t + 6
    rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    positions = torch.randint(0, 64, (t,), device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)
    k_before = k.clone()
    k_cache = torch.randn(slots, hk, head_dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(slots, hk, head_dim, device=DEVICE, dtype=dtype)
    k_old, v_old = k_cache.clone(), v_cache.clone()
    loc = torch.randperm(slots, generator=torch.Generator().manual_seed(t))[:t].to(DEVICE)
    assert rope.can_store(q, k_cache) == q.is_cuda
    fused_ops.rotary_inplace(q, k, cos, sin, head_dim, v, k_cache, v_cache, loc)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(k_cache[loc].float(), want_k.view(t, hk, head_dim).float(), **tol)
    assert torch.equal(v_cache[loc], v.reshape(t, hk, head_dim))
    assert torch.equal(k, k_before)
    others = torch.ones(slots, dtype=torch.bool)
    others[loc.cpu()] = False
    assert torch.equal(k_cache[others.to(DEVICE)], k_old[others.to(DEVICE)])
    assert torch.equal(v_cache[others.to(DEVICE)], v_old[others.to(DEVICE)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 80, device=DEVICE, dtype=dtype)
    d = 80
    want = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    got = fused_ops.silu_and_mul(x)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert isinstance(SiluAndMul()(x), torch.Tensor)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rotary_store_into_an_fp8_cache(kv_dtype):
    """Into an fp8 cache the fused store writes k and v at the token's slot, clamped to the
    format's range. At position 0 (no rotation) with k and v already on the fp8 grid the result
    is exact. (Rounding fp32 to fp8 is the hardware's: Triton's CPU interpreter drops the carry
    when the mantissa rounds up, e.g. -1.968 becomes -1.0 instead of -2.0.)"""
    torch.manual_seed(0)
    head_dim, hq, hk, t, slots = 32, 4, 2, 5, 16
    rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0).to(DEVICE)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim).to(kv_dtype).float().to(DEVICE)
    qkv[0, (hq + hk) * head_dim] = 1e6  # beyond either format's range: clamped, not inf/nan
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    cos, sin = rope.cos_sin(torch.zeros(t, dtype=torch.long, device=DEVICE), torch.float32)
    top = torch.finfo(kv_dtype).max
    k_cache = torch.zeros(slots, hk, head_dim, device=DEVICE, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.tensor([3, 9, 0, 15, 7], device=DEVICE)
    fused_ops.rotary_inplace(q, k, cos, sin, head_dim, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache[loc].float(), k.reshape(t, hk, head_dim))
    assert torch.equal(v_cache[loc].float(), v.reshape(t, hk, head_dim).clamp(-top, top))
    assert v_cache[3, 0, 0].float() == top


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("hq,hk,t", [(4, 2, 3), (4, 2, 70)])
def test_rotary_with_the_qk_norm(dtype, gemma, store, hq, hk, t):
    """Qwen3's and Gemma 3's per-head q/k RMSNorm fused into the rotary kernel (and its KV
    store): the layers' plain-PyTorch norm over each head, then the rotation."""
    from loom.layers.layernorm import GemmaRMSNorm

    torch.manual_seed(0)
    head_dim, slots = 32, 2 * t
    rope = RotaryEmbedding(head_dim, head_dim, 64, 10000.0).to(DEVICE)
    norms = []
    for _ in range(2):
        norm = (GemmaRMSNorm if gemma else RMSNorm)(head_dim, eps=1e-6).to(DEVICE, dtype)
        norm.weight.data = torch.randn(head_dim, device=DEVICE).to(dtype)
        if gemma:
            norm.process_weights_after_loading()
        norms.append(norm)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, device=DEVICE, dtype=dtype) * 3
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    positions = torch.randint(0, 64, (t,), device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)

    def plain(x, norm):  # the layer's PyTorch path (fused_ops off on CPU tensors)
        h = x.float().reshape(-1, head_dim)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        w = 1.0 + norm.weight.float() if gemma else norm.weight.float()
        return rope._rotate((w * h).to(dtype).reshape(t, -1), cos, sin)

    want_q, want_k = plain(q, norms[0]), plain(k, norms[1])
    qk_norm = (norms[0].kernel_weight(), norms[1].kernel_weight(), 1e-6)
    tol = dict(atol=2 * TOL[dtype], rtol=2 * TOL[dtype])
    if store:
        k_cache = torch.zeros(slots, hk, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        loc = torch.arange(t, device=DEVICE) * 2
        fused_ops.rotary_inplace(
            q, k, cos, sin, head_dim, v, k_cache, v_cache, loc, qk_norm=qk_norm
        )
        got_k = k_cache[loc].reshape(t, -1)
        assert torch.equal(v_cache[loc].reshape(t, -1), v)
    else:
        fused_ops.rotary_inplace(q, k, cos, sin, head_dim, qk_norm=qk_norm)
        got_k = k
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(got_k.float(), want_k.float(), **tol)
