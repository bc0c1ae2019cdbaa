"""Conformance kit of the attention_backend family: extend and decode over a paged pool against
dense attention in plain PyTorch."""

from __future__ import annotations

import random

import torch

from loom import plugins


def _reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    window: int = 0,
    cap: float = 0.0,
) -> torch.Tensor:
    """Dense causal attention for one request in plain PyTorch (fp32): q [n, H, D], k/v [S, Hk, D],
    query i sits at position p = prefix_len + i and sees keys 0..p, or with a window only keys j
    with p - window < j <= p; a cap soft-caps the scaled scores to cap * tanh(score / cap)."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap:
        scores = cap * torch.tanh(scores / cap)
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + prefix_len
    k_pos = torch.arange(k.shape[0]).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def check_attention_backend(
    name: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    seed: int = 0,
    atol: float | None = None,
    head_dim: int = 16,
    kv_dtype: torch.dtype | None = None,
    sliding_window: int = 0,
    logit_cap: float = 0.0,
) -> None:
    """Extend (with and without cached prefixes, and ending in one-token rows as a mixed step's
    decoding requests do) and decode over a paged pool with scattered, non-contiguous pages,
    against dense attention computed in plain PyTorch, with GQA (4 query heads over 2 KV heads).
    ``kv_dtype``: a KV cache narrower than ``dtype`` (fp8); the reference then reads K/V
    rounded the same way. ``sliding_window`` / ``logit_cap``: the layer's
    (``Attention.sliding_window`` / ``logit_cap``), declared in the context's ``features``;
    a backend whose ``features`` lack them is refused by its constructor (ValueError), so run
    the kit with them only where they are declared. The requests' sequences (up to 65 tokens)
    reach past a window of 8 and stay inside one of 100."""
    from loom.forward_batch import ForwardBatch, ForwardMode
    from loom.layers.attention.base import AttentionContext
    from loom.layers.attention.layer import Attention
    from loom.mem_cache.memory_pool import KVPool, PageAllocator, ReqToTokenPool

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    heads, kv_heads, num_pages = 4, 2, 256
    pool = KVPool(num_pages, page_size, 1, kv_heads, head_dim, kv_dtype or dtype, device)

    def stored(x: torch.Tensor) -> torch.Tensor:  # K/V as the pool keeps them, in ``dtype``
        x = x.to(dtype)
        return x if kv_dtype is None else x.to(kv_dtype).to(dtype)

    table = ReqToTokenPool(8, 512, device)
    alloc = PageAllocator(num_pages, page_size)
    rng.shuffle(alloc._free)  # scattered pages catch backends that assume contiguity
    features = frozenset(
        f for f, used in (("sliding_window", sliding_window), ("logit_cap", logit_cap)) if used
    )
    backend = plugins.resolve("attention_backend", name)(
        AttentionContext(heads, kv_heads, head_dim, dtype, device, pool, table, features)
    )
    layer = Attention(0, heads, kv_heads, head_dim, head_dim**-0.5, sliding_window, logit_cap)
    extra = {"window": sliding_window, "cap": logit_cap}
    what = f"{name} (window {sliding_window}, cap {logit_cap})" if features else name
    tol = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2)

    # a one-token row between prompts (the extend path's), and one at the end (which backends
    # may hand to their decode kernel, as a mixed step's decoding requests)
    prefix_lens = [0, 5, 17, 0, 40]
    extend_lens = [9, 1, 30, 64, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    full_k = [torch.randn(s + 1, kv_heads, head_dim, generator=gen) for s in seq_lens]
    full_v = [torch.randn(s + 1, kv_heads, head_dim, generator=gen) for s in seq_lens]
    rows = []
    for s in seq_lens:
        row = table.alloc()
        pages = alloc.alloc(-(-(s + 1) // page_size))
        slots = torch.tensor(
            [pages[i // page_size] * page_size + i % page_size for i in range(s + 1)]
        )
        table.req_to_token[row, : s + 1] = slots.to(device)
        rows.append(row)

    def run(mode, input_lens, prefixes, q, ks, vs):
        locs = torch.cat(
            [
                table.req_to_token[r, p : p + n]
                for r, p, n in zip(rows, prefixes, input_lens, strict=True)
            ]
        )
        seqs = [p + n for p, n in zip(prefixes, input_lens, strict=True)]
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.zeros(sum(input_lens), dtype=torch.long, device=device),
            positions=torch.cat(
                [torch.arange(p, p + n) for p, n in zip(prefixes, input_lens, strict=True)]
            ).to(device),
            out_cache_loc=locs,
            req_pool_indices=torch.tensor(rows, device=device),
            seq_lens=torch.tensor(seqs, device=device),
            seq_lens_cpu=seqs,
            extend_prefix_lens_cpu=prefixes if mode is ForwardMode.EXTEND else None,
            extend_seq_lens_cpu=input_lens if mode is ForwardMode.EXTEND else None,
            req_to_token_pool=table,
            kv_pool=pool,
            attn_backend=backend,
        )
        backend.init_forward_metadata(batch)
        out = backend.forward(
            q.to(device, dtype), ks.to(device, dtype), vs.to(device, dtype), layer, batch
        )
        assert out.shape == (q.shape[0], heads * head_dim), f"{name}: output shape {out.shape}"
        return out.float().cpu()

    # Cached prefixes are written directly into the pool (as an earlier forward would have).
    for r, p, k, v in zip(rows, prefix_lens, full_k, full_v, strict=True):
        if p:
            locs = table.req_to_token[r, :p]
            pool.set_kv(0, locs, k[:p].to(device, dtype), v[:p].to(device, dtype))
    q = torch.randn(sum(extend_lens), heads * head_dim, generator=gen)
    ks = torch.cat([k[p : p + e] for k, p, e in zip(full_k, prefix_lens, extend_lens, strict=True)])
    vs = torch.cat([v[p : p + e] for v, p, e in zip(full_v, prefix_lens, extend_lens, strict=True)])
    out = run(ForwardMode.EXTEND, extend_lens, prefix_lens, q, ks.flatten(1), vs.flatten(1))
    start = 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        ref = _reference_attention(
            q[start : start + e].view(e, heads, head_dim),
            stored(full_k[i][: p + e]),
            stored(full_v[i][: p + e]),
            p,
            head_dim**-0.5,
            **extra,
        )
        err = (out[start : start + e] - ref.flatten(1)).abs().max().item()
        assert err < tol, f"{what}: extend of request {i} (prefix {p}) off by {err:.2e}"
        start += e

    # Decode one more token per request on top of everything above.
    qd = torch.randn(len(rows), heads * head_dim, generator=gen)
    kd = torch.stack([k[s] for k, s in zip(full_k, seq_lens, strict=True)])
    vd = torch.stack([v[s] for v, s in zip(full_v, seq_lens, strict=True)])
    out = run(ForwardMode.DECODE, [1] * len(rows), seq_lens, qd, kd.flatten(1), vd.flatten(1))
    for i, s in enumerate(seq_lens):
        ref = _reference_attention(
            qd[i].view(1, heads, head_dim),
            stored(full_k[i][: s + 1]),
            stored(full_v[i][: s + 1]),
            s,
            head_dim**-0.5,
            **extra,
        )
        err = (out[i] - ref.flatten()).abs().max().item()
        assert err < tol, f"{what}: decode of request {i} off by {err:.2e}"
