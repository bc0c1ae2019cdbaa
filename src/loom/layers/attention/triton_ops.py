"""Loom's Triton attention kernels over the paged KV pool.

- ``decode_attention``: one query token per request, flash-decoding style. Stage 1 splits each
  request's KV into ``num_splits`` chunks (one program per request x KV head x split, all query
  heads of the GQA group together) and writes a partial output and log-sum-exp per split; stage 2
  merges the splits. Everything it reads about the batch lives in device tensors (``seq_lens``,
  ``req_pool_indices``) and the grid depends only on the batch size, so it can be captured in a
  CUDA graph.
- ``extend_attention``: new tokens attend to their request's cached prefix plus themselves,
  causally (their own K/V are already in the pool). One program per request x query head x block
  of new tokens.

Both take a layer's sliding window and logit soft cap (``Attention.sliding_window``,
``Attention.logit_cap``) behind constexpr flags, so a plain layer compiles to the same code as
without them. A window moves the start of the KV loop to the first key the earliest query of
the program sees (decode: ``seq_len - window``; extend: the block's first position minus
``window - 1``), so the KV outside the window is never read and a long context costs
O(window); the split-KV decode divides the window, not the sequence, among its splits.

KV slots come from the req-to-token table, so pages may lie anywhere in the pool. Under
``TRITON_INTERPRET=1`` both run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.mem_cache.memory_pool import FP8_DTYPES

# fp8 K/V (FP8_DTYPES) under a 16-bit query: the dots run in fp16 (the query rounded from bf16,
# the probabilities in [0, 1]), since fp8 -> fp16 is one conversion instruction per two elements
# and fp8 -> bf16 goes through fp32. With bf16 dots the H200 decoded slower over an fp8 cache
# than over bf16 (docs/benchmarks.md).


@triton.jit
def _decode_stage1(
    Q,
    K,
    V,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Order,
    MidO,
    MidLse,
    Out,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    scale,
    window,
    logit_cap,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP16: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    KVP: tl.constexpr = 1,
    ORDERED: tl.constexpr = False,
    HAS_WINDOW: tl.constexpr = False,
    HAS_CAP: tl.constexpr = False,
):
    if ORDERED:  # programs take requests in the given order (longest first: see decode_attention)
        b = tl.load(Order + tl.program_id(0))
    else:
        b = tl.program_id(0)
    kv_head = tl.program_id(1)  # the program's first KV head / KVP (KVP heads a program)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    row = tl.load(ReqPoolIdx + b)
    # The query sits at position seq_len - 1; with a window it sees the last `window` keys
    # only, and the splits share those alone.
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    else:
        kv_start = 0
    # Splits cover whole BLOCK_N tiles (the last one may be shorter, trailing ones empty): a
    # chunk of cdiv(kv_len, NUM_SPLITS) tokens would end each split on a partly masked tile.
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = kv_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP * KVP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * (GROUP * KVP) + offs_h
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if not USE_DOT:
        q = q.to(tl.float32)
    elif (
        DOT_FP16
    ):  # fp8 K/V: fp16 dots (see FP8_DTYPES above); a bf16 query is clamped to fp16's range
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # KVP > 1: a tile row per (token, KV head), the heads of a token adjacent (one contiguous
    # KVP * head_dim run of the pool per token); query rows attend only to their own head's
    # rows (a block-diagonal mask), so one program reads KVP heads' K/V per slot lookup
    offs_r = tl.arange(0, BLOCK_N * KVP)
    # PREFETCH: the next tile's slots load while this tile's K/V are in flight, so each
    # iteration waits on one round trip instead of two (slots, then the K/V they point to)
    if PREFETCH:
        first = start + offs_r // KVP
        loc = tl.load(ReqToToken + row * stride_rt + first, mask=first < end, other=0)
    if KVP > 1:
        r_head = (kv_head * KVP + offs_r % KVP)[:, None]  # each tile row's KV head
        k_head = r_head * stride_kh
        v_head = r_head * stride_vh
    else:
        k_head = kv_head * stride_kh
        v_head = kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        if KVP > 1:
            offs_n = n0 + offs_r // KVP
        else:
            offs_n = n0 + offs_r
        n_mask = offs_n < end
        if not PREFETCH:
            loc = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_mask, other=0)
        k = tl.load(
            K + loc[:, None] * stride_kt + k_head + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # V depends only on the slots: issue its load now, so both are in flight together.
        v = tl.load(
            V + loc[:, None] * stride_vt + v_head + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if PREFETCH:
            nxt = offs_n + BLOCK_N
            loc = tl.load(ReqToToken + row * stride_rt + nxt, mask=nxt < end, other=0)
        if USE_DOT:  # the GQA group, padded to 16 rows, on tensor cores
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION).to(tl.float32)
            s = s * scale
        else:
            k = k.to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_H, BLOCK_N]
        if HAS_CAP:
            # cap * tanh(s / cap), tanh by exp (Triton has no tanh the interpreter runs, and a
            # helper function costs the interpreter a patching per call): exp overflowing to
            # inf gives cap, underflowing to 0 gives -cap
            s = logit_cap - 2.0 * logit_cap / (tl.exp(s * (2.0 / logit_cap)) + 1.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        if KVP > 1:  # each query row keeps its own head's rows
            own = (offs_h // GROUP)[:, None] == (offs_r % KVP)[None, :]
            s = tl.where(own | ~h_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        if USE_DOT:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION).to(tl.float32)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:  # the whole row in one program: the output itself, no merge
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=h_mask[:, None] & d_mask[None, :],
        )
    else:
        has = end > start
        lse = tl.where(has, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(
            MidO
            + b * stride_mob
            + heads[:, None] * stride_moh
            + split * stride_mos
            + offs_d[None, :],
            out,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(MidLse + b * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, axis=0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    o = tl.load(
        MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask
    )


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool = False,
    kv_per_program: int = 1,
    order: torch.Tensor | None = None,
    window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """q ``[bs, num_heads, head_dim]``; k/v_buf ``[slots, kv_heads, head_dim]``. The scratch
    buffers may be passed in (fixed addresses for CUDA graphs). ``use_dot`` computes each GQA
    group's scores and outputs with ``tl.dot`` (tensor cores, group padded to 16 rows; the
    probabilities are rounded to the query dtype for the second product, as FlashInfer does)
    instead of fp32 broadcast products. Default: dot for fp16/bf16, plain (exact) for fp32: on the
    H200 (bench/attn_micro.py, Llama-3-8B heads) dot took 5.6 vs 9.8 us at batch 1 / 256 tokens
    and 82 vs 504 us at batch 64 / 1,024 tokens (FlashInfer: 10.4, 77 us). ``block_n``: KV tokens
    per loop iteration (default 64 for the dot variant, 32 for the plain one; for measuring,
    e.g. 128 over an fp8 cache, whose 64-token tiles carry half the bytes per round trip);
    ``num_warps`` / ``num_stages``: Triton's launch options (default: Triton's), also for
    measuring (bench/attn_micro.py); ``prefetch``: load the next tile's slot indices while this
    tile's K/V are in flight (for measuring); ``kv_per_program``: KV heads one program reads
    (a power of two dividing the KV heads; tiles of block_n tokens x that many heads, read as
    one contiguous run per token; for measuring, e.g. over fp8 caches); ``order``: the batch
    rows in the order programs take them (``[bs]``, a permutation), e.g. longest first, so
    that the grid's last programs are short ones instead of whichever requests came last
    (ragged contexts otherwise leave the GPU half idle behind a few long rows). ``window``: the
    query sees only the last ``window`` keys (0: all); ``logit_cap``: scores soft-capped to
    ``cap * tanh(score / cap)`` after scaling (0: none)."""
    if use_dot is None:
        use_dot = q.dtype != torch.float32
    bs, num_heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group = num_heads // kv_heads
    kvp = kv_per_program
    if kvp < 1 or kvp & (kvp - 1) or kv_heads % kvp:
        raise ValueError(f"kv_per_program={kvp}: a power of two dividing {kv_heads} KV heads")
    if mid_o is None:  # one split writes the output directly: no scratch (placeholders)
        shape = (bs, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
        mid_o = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(*shape, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    block_d = triton.next_power_of_2(head_dim)
    _decode_stage1[(bs, kv_heads // kvp, num_splits)](
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        seq_lens if order is None else order,
        mid_o,
        mid_lse,
        out,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        window,
        float(logit_cap),
        GROUP=group,
        BLOCK_H=max(triton.next_power_of_2(group * kvp), 16 if use_dot else 1),
        BLOCK_N=block_n or (64 if use_dot else 32),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        USE_DOT=use_dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP16=use_dot and q.dtype != torch.float32 and k_buf.dtype in FP8_DTYPES,
        PREFETCH=prefetch,
        KVP=kvp,
        ORDERED=order is not None,
        HAS_WINDOW=window > 0,
        HAS_CAP=logit_cap > 0,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v},
    )
    if num_splits == 1:  # stage 1 wrote the output
        return out
    _decode_stage2[(bs, num_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    ReqPoolIdx,
    QStart,
    ExtendLens,
    PrefixLens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    scale,
    window,
    logit_cap,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_CAP: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)
    ext = tl.load(ExtendLens + b)
    if mblock * BLOCK_M >= ext:
        return
    prefix = tl.load(PrefixLens + b)
    q_start = tl.load(QStart + b)
    row = tl.load(ReqPoolIdx + b)
    kv_head = h // GROUP

    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < ext
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix + offs_m  # absolute position of each query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the last query's position: the prefix and the causal part of the new tokens.
    kv_end = tl.minimum(prefix + (mblock + 1) * BLOCK_M, prefix + ext)
    # With a window, keys from the first query's window on: the block's later queries see
    # later keys only, so the loop reads window + BLOCK_M - 1 keys at most.
    if HAS_WINDOW:
        kv_start = tl.maximum(prefix + mblock * BLOCK_M - window + 1, 0)
    else:
        kv_start = 0
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        loc = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_mask, other=0)
        k = tl.load(
            K + loc[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION).to(tl.float32) * scale
        if HAS_CAP:  # cap * tanh(s / cap), as in _decode_stage1
            s = logit_cap - 2.0 * logit_cap / (tl.exp(s * (2.0 / logit_cap)) + 1.0)
        allowed = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(
            V + loc[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION
        ).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    q_start: torch.Tensor,
    extend_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    window: int = 0,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """q ``[num_tokens, num_heads, head_dim]`` (all requests' new tokens, concatenated).
    ``window`` / ``logit_cap``: as in :func:`decode_attention` (a query at position i sees keys
    j with ``i - window < j <= i``)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_buf.shape[1]
    out = torch.empty_like(q)
    block_m = 32 if head_dim <= 128 else 16
    grid = (req_pool_indices.shape[0], num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        q_start,
        extend_lens,
        prefix_lens,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        scale,
        window,
        float(logit_cap),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=32,
        # fp32 inputs: exact IEEE products (Triton's default TF32 is off by ~1e-3)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=window > 0,
        HAS_CAP=logit_cap > 0,
    )
    return out
