"""Vectorised sampling for a whole batch with per-request parameters.

Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocab entry (the "exponential
race", equivalent to drawing from ``probs``), which needs no host sync. Rows with a
``sampling_seed`` draw their noise from a generator seeded by (seed, output position), so a seeded
request gives the same tokens alone or in any batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom import plugins
from loom.sampling import triton_sampling
from loom.sampling.base import TokenHistory
from loom.sampling.sampling_params import SamplingParams
from loom.sampling.sglang_processor import SGLangProcessor, is_serialized
from loom.sampling.sglang_processor import load as load_sglang_processor


@dataclass
class SamplingBatchInfo:
    # Per-row tensors; None when every row is greedy (argmax needs none of them).
    temperatures: torch.Tensor | None  # [bs, 1], 1.0 on greedy rows
    top_ps: torch.Tensor | None  # [bs]
    top_ks: torch.Tensor | None  # [bs] (vocab size when disabled)
    min_ps: torch.Tensor | None  # [bs]
    greedy: torch.Tensor | None  # [bs] bool
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: list[tuple[int, int, int]]  # (row, seed, output position)
    processors: dict[str, list[int]]  # processor name -> rows
    params: torch.Tensor | None = None  # [5, bs]: the rows above, for the fused GPU kernel

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_lens: list[int],
        vocab_size: int,
        device: torch.device,
        with_params: bool = False,
    ) -> SamplingBatchInfo:
        """``with_params``: build the ``[5, bs]`` rows even when every row is greedy (the fused
        kernel also serves greedy rows when it applies penalties or bias)."""
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        processors: dict[str, list[int]] = {}
        for i, p in enumerate(params):
            if p.custom_logit_processor:
                processors.setdefault(p.custom_logit_processor, []).append(i)
        bs = len(params)
        info = cls(
            temperatures=None,
            top_ps=None,
            top_ks=None,
            min_ps=None,
            greedy=None,
            is_all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(p.min_p > 0 for p in params),
            seeds=[
                (i, p.sampling_seed, n)
                for i, (p, n) in enumerate(zip(params, output_lens, strict=True))
                if p.sampling_seed is not None
            ],
            processors=processors,
        )
        if info.is_all_greedy and not with_params:
            return info  # argmax needs no per-row tensors: nothing to copy to the device
        # One host-to-device copy for all per-row parameters.
        rows = torch.tensor(
            [
                [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)],
                [float(p.top_p) for p in params],
                [float(k) for k in top_ks],
                [float(p.min_p) for p in params],
                [1.0 if g else 0.0 for g in greedy],
            ],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        info.params = rows
        info.temperatures = rows[0].view(bs, 1)
        info.top_ps = rows[1]
        info.top_ks = rows[2].to(torch.int64)
        info.min_ps = rows[3]
        info.greedy = rows[4].bool()
        return info


def apply_logits_processors(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    reqs: list,
    on_error: Callable[[int, Exception], None] | None = None,
) -> torch.Tensor:
    """Each processor over its rows, in one call. ``reqs``: the batch's rows (``rid``,
    ``sampling_params``, ``origin_input_ids``, ``output_ids``, ``is_finished``). If that call
    fails (or returns logits of another shape) and ``on_error`` is given, the rows are retried
    one by one and each failing row is reported to it, its logits left as they were: a
    processor that fails on one request's parameters fails that request alone."""
    for name, rows in info.processors.items():
        try:
            _apply_processor(name, logits, rows, reqs)
        except Exception:
            if on_error is None:
                raise
            for r in rows:
                try:
                    _apply_processor(name, logits, [r], reqs)
                except Exception as e:  # noqa: BLE001 - reported, isolated to row r
                    on_error(r, e)
    return logits


def _apply_processor(name, logits, rows, reqs) -> None:
    proc = get_processor(name)
    idx = torch.tensor(rows, device=logits.device)
    sub = logits[idx]
    picked = [reqs[r] for r in rows]
    if isinstance(proc, SGLangProcessor):
        label = proc.name
        out = proc.apply(sub, picked)
    else:
        label = name
        params = [r.sampling_params.custom_params or {} for r in picked]
        out = proc(sub, params, [TokenHistory.of(r.origin_input_ids, r.output_ids) for r in picked])
    if not isinstance(out, torch.Tensor) or out.shape != sub.shape:
        raise ValueError(
            f"logits processor {label!r} returned {getattr(out, 'shape', type(out).__name__)}, "
            f"not logits of shape {tuple(sub.shape)}"
        )
    logits[idx] = out.to(logits.dtype)


_processor_cache: dict[str, object] = {}


def get_processor(name: str):
    """A named plug-in's instance (one per process), or for SGLang's serialised form (admitted
    only with --enable-custom-logit-processor) its rebuilt instance."""
    if is_serialized(name):
        return load_sglang_processor(name)
    if name not in _processor_cache:
        target = plugins.resolve("logits_processor", name)
        _processor_cache[name] = target() if isinstance(target, type) else target
    return _processor_cache[name]


def _zero_filtered(sorted_probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero what top_k / top_p / min_p exclude from probabilities sorted in descending order
    (true probabilities of the whole vocabulary, or a prefix of them); the top token stays."""
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k:
        ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).unsqueeze(0)
        drop |= ranks >= info.top_ks.unsqueeze(1)
    if info.need_top_p:
        # drop a token when the mass strictly before it already reaches top_p
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= info.top_ps.unsqueeze(1)
    if info.need_min_p:
        drop |= sorted_probs < (sorted_probs[:, :1] * info.min_ps.unsqueeze(1))
    drop[:, 0] = False
    return sorted_probs.masked_fill(drop, 0.0)


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities that top_k / top_p / min_p exclude (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    return torch.zeros_like(probs).scatter_(-1, order, _zero_filtered(sorted_probs, info))


# On CPU, rows whose top-k / top-p / min-p set provably lies within their CANDIDATES most likely
# tokens sample among those alone (a full-vocabulary sort costs ~47 ms for 32 x 49k on this
# machine's two cores, a top-1024 ~5 ms). The choice depends only on the row, so seeded rows stay
# reproducible in any batch. On CUDA every row takes the full path: no data-dependent split, no
# host sync.
CANDIDATES = 1024


@functools.cache
def _vocab_split(vocab: int) -> int:
    """The divisor of ``vocab`` nearest its square root (1 if there is none in [32, 4096])."""
    root = math.isqrt(vocab)
    best = 1
    for c in range(32, 4097):
        if vocab % c == 0 and abs(c - root) < abs(best - root):
            best = c
    return best


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximum of each row). On a GPU, a few rows over a large
    vocabulary reduce in two stages: one row's single-output reduction used a fraction of the
    GPU (28 us for Llama-3's 128,256 entries on an H200)."""
    bs, vocab = logits.shape
    if not logits.is_cuda or bs > 16 or vocab < 8192:
        return logits.argmax(dim=-1)
    c = _vocab_split(vocab)
    if c == 1:
        return logits.argmax(dim=-1)
    return argmax_two_stage(logits, c)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def masked_argmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row among its allowed tokens: ``mask`` is a grammar bitmask
    on ``logits``' device (``[bs, words]`` int32, 32 tokens a word, bit set = allowed). Five
    PyTorch launches and no Triton one, so on a GPU its host cost is what a greedy constrained
    step pays least (a Triton launch costs ~30 us of host time there; docs/benchmarks.md)."""
    bs, vocab = logits.shape
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(
            32, dtype=torch.int32, device=logits.device
        )
    allowed = (mask.unsqueeze(-1) >> shifts).bitwise_and_(1).view(bs, -1)[:, :vocab]
    return torch.where(allowed.bool(), logits, float("-inf")).argmax(dim=-1)


def argmax_two_stage(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """Row argmax via ``chunks`` equal chunks (``chunks`` divides the vocabulary)."""
    bs, vocab = logits.shape
    width = vocab // chunks
    vals, idx = logits.view(bs, chunks, width).max(dim=-1)  # first maximum within each chunk
    best = vals.argmax(dim=-1)  # the first chunk holding the row's maximum
    return best * width + idx.gather(1, best.unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Token ids ``[bs]`` for fp32 ``logits [bs, vocab]``."""
    if info.is_all_greedy:
        return argmax_rows(logits)
    if info.params is not None and triton_sampling.enabled(logits):
        search = info.need_top_k or info.need_top_p
        return triton_sampling.fused_sample(logits, info.params, info.seeds, search=search)
    greedy_ids = argmax_rows(logits)
    scaled = logits / info.temperatures
    filtered = info.need_top_k or info.need_top_p or info.need_min_p
    if logits.is_cuda or not filtered or logits.shape[-1] <= CANDIDATES:
        sampled = _sample_full(scaled, info, None)
        return torch.where(info.greedy, greedy_ids, sampled)
    return _sample_cpu(scaled, info, greedy_ids)


def _noise(rows: list[int] | None, n: int, width: int, info: SamplingBatchInfo, device):
    """Exponential noise ``[n, width]`` for batch ``rows`` (None: all rows, in order); seeded
    rows draw from their own generators (host-side seeding: no device sync)."""
    # -log(U) is Exponential(1); torch's uniform generator is several times faster on CPU than
    # exponential_ (3 vs 22 ms for 32 x 49k).
    noise = -torch.rand((n, width), device=device).log()
    if info.seeds:
        where = {r: i for i, r in enumerate(rows)} if rows is not None else None
        for row, seed, position in info.seeds:
            i = row if where is None else where.get(row)
            if i is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
                noise[i] = -torch.rand(width, device=device, generator=gen).log()
    return noise


def _sub(info: SamplingBatchInfo, rows: torch.Tensor) -> SamplingBatchInfo:
    import dataclasses

    def take(t):
        return None if t is None else t.index_select(0, rows)

    return dataclasses.replace(
        info,
        temperatures=take(info.temperatures),
        top_ps=take(info.top_ps),
        top_ks=take(info.top_ks),
        min_ps=take(info.min_ps),
        greedy=take(info.greedy),
        params=None if info.params is None else info.params.index_select(1, rows),
    )


def _sample_full(scaled: torch.Tensor, info: SamplingBatchInfo, rows: list[int] | None):
    probs = torch.softmax(scaled, dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = filter_probs(probs, info)
    noise = _noise(rows, probs.shape[0], probs.shape[-1], info, probs.device)
    return (probs / noise).argmax(dim=-1)


def _sample_cpu(scaled: torch.Tensor, info: SamplingBatchInfo, greedy_ids: torch.Tensor):
    k = CANDIDATES
    vals, idx = scaled.topk(k, dim=-1)
    probs = (vals - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp()  # true probabilities
    bounded = torch.zeros(len(scaled), dtype=torch.bool)
    if info.need_top_k:
        bounded |= info.top_ks <= k
    if info.need_top_p:
        bounded |= (info.top_ps < 1) & (probs.sum(-1) >= info.top_ps)
    if info.need_min_p:
        bounded |= (info.min_ps > 0) & (probs[:, -1] < info.min_ps * probs[:, 0])
    bounded &= ~info.greedy
    out = greedy_ids.clone()
    cand = bounded.nonzero().flatten()
    if len(cand):
        p = _zero_filtered(probs.index_select(0, cand), _sub(info, cand))
        pick = (p / _noise(cand.tolist(), len(cand), k, info, p.device)).argmax(dim=-1)
        out[cand] = idx.index_select(0, cand).gather(1, pick.unsqueeze(1)).squeeze(1)
    rest = (~bounded & ~info.greedy).nonzero().flatten()
    if len(rest):
        out[rest] = _sample_reject(scaled.index_select(0, rest), _sub(info, rest), rest.tolist())
    return out


def _sample_reject(scaled: torch.Tensor, info: SamplingBatchInfo, rows: list[int]):
    """CPU rows whose filtered set may reach past the candidates: draw from the whole softmax
    and redraw the rows whose token top-k / top-p / min-p exclude (rejection sampling gives
    exactly the renormalised filtered distribution); membership is one pass, no sort."""
    probs = torch.softmax(scaled, dim=-1)
    pmax = probs.max(dim=-1, keepdim=True).values
    out = torch.empty(len(rows), dtype=torch.int64)
    todo = list(range(len(rows)))
    seeds = {row: (seed, pos) for row, seed, pos in info.seeds}
    gens = {}
    for i, row in enumerate(rows):
        if row in seeds:
            seed, pos = seeds[row]
            gens[i] = torch.Generator().manual_seed(
                (seed * 1_000_003 + pos) & 0x7FFF_FFFF_FFFF_FFFF
            )
    for _ in range(1000):
        sel = torch.tensor(todo)
        p = probs.index_select(0, sel)
        noise = -torch.rand(p.shape).log()
        for j, i in enumerate(todo):
            if i in gens:
                noise[j] = -torch.rand(p.shape[-1], generator=gens[i]).log()
        tok = (p / noise).argmax(dim=-1)
        pt = p.gather(1, tok.unsqueeze(1))
        ok = torch.ones(len(todo), dtype=torch.bool)
        if info.need_top_k:
            ok &= ((p > pt).sum(-1) < info.top_ks.index_select(0, sel)) | (tok == p.argmax(-1))
        if info.need_top_p:
            above = (p * (p > pt)).sum(-1)
            ok &= (above < info.top_ps.index_select(0, sel)) | (tok == p.argmax(-1))
        if info.need_min_p:
            ok &= pt.squeeze(1) >= info.min_ps.index_select(0, sel) * pmax.index_select(
                0, sel
            ).squeeze(1)
        for j in ok.nonzero().flatten().tolist():
            out[todo[j]] = tok[j]
        todo = [i for j, i in enumerate(todo) if not ok[j]]
        if not todo:
            return out
    raise RuntimeError("rejection sampling did not converge")
