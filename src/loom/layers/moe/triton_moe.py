"""The Triton path of the fused MoE layer: every expert's MLP in two grouped-GEMM launches.

1. **Align** (``_moe_align_kernel``, one program). The ``T * k`` routed rows (row ``t * k + j``
   is token ``t``'s ``j``-th expert) are grouped by expert, stably, and each expert's group is
   padded to a multiple of ``BLOCK_M``: ``sorted_ids`` lists the row indices group after group
   (pads hold the sentinel ``T * k``), ``expert_ids`` names the expert of each ``BLOCK_M``-row
   block, ``num_post_padded`` is the padded total. Two passes over the ids (a histogram, then
   placement with ranks from a one-hot prefix sum), all in one launch.
2. **Gate-up GEMM** (``_moe_gemm_kernel``, ``SILU_MUL``). A program takes one block of rows
   (one expert) and ``BLOCK_N`` intermediate columns, gathers the rows' tokens from ``hidden``,
   and accumulates the gate columns ``w13[e, n]`` and the up columns ``w13[e, I + n]`` side by
   side; its epilogue applies ``silu(gate) * up`` and writes ``[T * k, I]`` directly, so the
   ``2 * I`` gate-up activations never reach memory.
3. **Down GEMM** (``MUL_WEIGHT``): the same kernel over ``w2``; its epilogue multiplies each row
   by its routing weight (in fp32) and writes ``[T * k, H]``.
4. ``sum`` over the k rows of each token.

CUDA-graph safety: nothing reads the device from the host. Buffers and grids depend only on
``T``, ``k`` and the weights' shapes: the padded buffer has room for the worst case,
``T * k + min(E, T * k) * (BLOCK_M - 1)`` rows (at most ``min(E, T * k)`` experts are non-empty,
each wasting fewer than ``BLOCK_M`` rows), and GEMM programs whose block starts at or past
``num_post_padded`` (read from device memory) return at once. Block sizes are picked from
``T`` alone (``default_config``), so a captured batch size always replays the same kernels.

Dots accumulate in fp32 (fp32 inputs use IEEE products, not TF32); the intermediate and the
per-row outputs are rounded to the activation dtype, as HF's per-expert loop rounds them.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


@dataclass(frozen=True)
class MoEConfig:
    """Block sizes of one fused-MoE call: ``block_m`` rows per expert block (shared by the align
    step and both GEMMs), and each GEMM's tile."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """Block sizes by the expected rows per expert (``T * k / E``, uniform routing). Decode
    (a few rows per expert) is a weight-streaming GEMV: 16-row blocks and deep K tiles; larger
    batches take taller blocks so each weight tile is reused by more rows."""
    rows = num_tokens * top_k / num_experts
    if rows <= 16:
        return MoEConfig(16, GemmConfig(64, 128, 4, 4), GemmConfig(64, 128, 4, 4))
    if rows <= 48:
        return MoEConfig(32, GemmConfig(64, 128, 4, 4), GemmConfig(64, 128, 4, 4))
    if rows <= 128:
        return MoEConfig(64, GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 4, 4))
    return MoEConfig(128, GemmConfig(64, 64, 8, 3), GemmConfig(128, 64, 8, 3))


@triton.jit
def _moe_align_kernel(
    TopkIds,
    SortedIds,
    ExpertIds,
    NumPost,
    numel,
    num_experts,
    num_slots,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_POW2)
    # every slot starts as a pad (the sentinel numel); placement below overwrites the real rows
    for s in range(0, num_slots, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        tl.store(SortedIds + offs, tl.zeros([CHUNK], tl.int32) + numel, mask=offs < num_slots)
    counts = tl.zeros([E_POW2], tl.int32)
    for s in range(0, numel, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + offs, mask=offs < numel, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(NumPost, tl.sum(padded, axis=0))
    # a block's expert: the number of experts whose padded group ends at or before the block
    # (empty experts before it count, empty ones after it and the E..E_POW2 fillers do not)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        e = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(ExpertIds + blocks, tl.minimum(e, num_experts - 1), mask=blocks < num_blocks)
    tl.debug_barrier()  # the pad fill above lands before the placement below overwrites it
    next_slot = ends - padded  # each expert's next free slot, advanced chunk by chunk
    for s in range(0, numel, CHUNK):
        offs = s + tl.arange(0, CHUNK)
        ids = tl.load(TopkIds + offs, mask=offs < numel, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        # rank among the chunk's rows of the same expert (stable: row order is kept)
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
        slot = tl.sum(onehot * next_slot[None, :], axis=1) + rank
        tl.store(SortedIds + slot, offs, mask=offs < numel)
        next_slot += tl.sum(onehot, axis=0)


@triton.jit
def _moe_gemm_kernel(
    A,
    B,
    C,
    Weights,
    SortedIds,
    ExpertIds,
    NumPost,
    N,
    K,
    num_valid,
    rows_per_a,
    up_offset,
    num_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # C[row] = A[row // rows_per_a] @ B[expert].T over the rows of one expert block; with
    # SILU_MUL, silu(A @ B[e, :N].T) * (A @ B[e, up_offset:up_offset + N].T); with MUL_WEIGHT,
    # times the row's routing weight. Programs are grouped GROUP_M blocks at a time (L2 reuse).
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(NumPost):
        return
    rows = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_valid
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (rows // rows_per_a).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = B + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SILU_MUL:
            b_up = tl.load(
                b_ptrs + up_offset * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0
            )
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(Weights + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class AlignedRows:
    sorted_ids: torch.Tensor  # [num_blocks * block_m] int32: row indices, pads = T * k
    expert_ids: torch.Tensor  # [num_blocks] int32 (blocks past num_post_padded: any expert)
    num_post_padded: torch.Tensor  # [1] int32
    block_m: int


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most rows the padded grouping can take (``num_rows = T * k``)."""
    return num_rows + min(num_experts, num_rows) * (block_m - 1)


def align_rows(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRows:
    """Group the routed rows of ``topk_ids [T, k]`` by expert, padded to ``block_m``-row blocks
    (device only: one single-program launch)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    numel = ids.numel()
    num_blocks = triton.cdiv(max_padded_rows(numel, num_experts, block_m), block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    num_post = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pow2 = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        num_post,
        numel,
        num_experts,
        sorted_ids.numel(),
        num_blocks,
        BLOCK_M=block_m,
        E_POW2=e_pow2,
        CHUNK=max(16, min(256, 4096 // e_pow2)),  # a [CHUNK, E_POW2] one-hot tile
        num_warps=4,
    )
    return AlignedRows(sorted_ids, expert_ids, num_post, block_m)


@functools.cache
def _shared_memory_limit(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # Triton's interpreter has no such limit
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["max_shared_mem"]


def _fit_shared_memory(
    cfg: GemmConfig, block_m: int, b_tiles: int, elem_size: int, device: torch.device
) -> GemmConfig:
    """``cfg`` with fewer pipeline stages, then shallower K tiles, until its buffers fit the
    device's shared memory: ``num_stages - 1`` copies of one A tile and ``b_tiles`` B tiles
    (two with SiLU-and-mul: gate and up). The tiles are sized for bf16; fp32 needs twice the
    bytes (Mixtral's 32-row blocks in fp32 ask 240 KiB of an H200's 227)."""
    limit = _shared_memory_limit(device)
    if limit is None:
        return cfg
    while True:
        tile = block_m * cfg.block_k + b_tiles * cfg.block_k * cfg.block_n
        if (cfg.num_stages - 1) * tile * elem_size <= limit or cfg.block_k <= 16:
            return cfg
        if cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        else:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    weights: torch.Tensor,
    aligned: AlignedRows,
    rows_per_a: int,
    cfg: GemmConfig,
    silu_mul: bool,
) -> None:
    n = c.shape[1]
    k = a.shape[1]
    cfg = _fit_shared_memory(cfg, aligned.block_m, 2 if silu_mul else 1, a.element_size(), a.device)
    num_blocks = aligned.expert_ids.numel()
    grid = (num_blocks * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        weights,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.num_post_padded,
        n,
        k,
        c.shape[0],
        rows_per_a,
        n,  # the up rows of w13 start right after the gate rows
        num_blocks,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        BLOCK_M=aligned.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SILU_MUL=silu_mul,
        MUL_WEIGHT=not silu_mul,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """``sum_j w[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t)`` over each token's experts
    ``e = topk_ids[t, j]``. ``hidden [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows),
    ``w2 [E, H, I]``, all one dtype with unit stride along their last dimension."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if hidden.dtype != w13.dtype or hidden.dtype != w2.dtype:
        raise ValueError(f"dtypes differ: hidden {hidden.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    if hidden.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("hidden, w13 and w2 need unit stride along their last dimension")
    if num_tokens == 0:
        return hidden.new_empty(0, hidden_size)
    config = config or default_config(num_tokens, top_k, num_experts)
    aligned = align_rows(topk_ids, num_experts, config.block_m)
    rows = num_tokens * top_k
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    act = hidden.new_empty(rows, inter)
    _gemm(hidden, w13, act, weights, aligned, top_k, config.gate_up, silu_mul=True)
    out = hidden.new_empty(rows, hidden_size)
    _gemm(act, w2, out, weights, aligned, 1, config.down, silu_mul=False)
    if top_k == 1:
        return out
    return out.view(num_tokens, top_k, hidden_size).sum(dim=1)
