"""Vectorised sampling for a whole batch with per-request parameters.

Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocab entry (the "exponential
race", equivalent to drawing from ``probs``), which needs no host sync. Rows with a
``sampling_seed`` draw their noise from a generator seeded by (seed, output position), so a seeded
request gives the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom import plugins
from loom.sampling.sampling_params import SamplingParams


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

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_lens: list[int],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatchInfo:
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
        if info.is_all_greedy:
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
        info.temperatures = rows[0].view(bs, 1)
        info.top_ps = rows[1]
        info.top_ks = rows[2].to(torch.int64)
        info.min_ps = rows[3]
        info.greedy = rows[4].bool()
        return info


def apply_logits_processors(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    params: list[SamplingParams],
    histories: list[list[int]],
) -> torch.Tensor:
    for name, rows in info.processors.items():
        proc = get_processor(name)
        idx = torch.tensor(rows, device=logits.device)
        sub = proc(
            logits[idx], [params[r].custom_params for r in rows], [histories[r] for r in rows]
        )
        logits[idx] = sub
    return logits


_processor_cache: dict[str, object] = {}


def get_processor(name: str):
    if name not in _processor_cache:
        from loom.sampling.logits_processor import SerializedProcessor, is_serialized

        if is_serialized(name):  # admitted only with --enable-custom-logit-processor
            _processor_cache[name] = SerializedProcessor(name)
        else:
            target = plugins.resolve("logits_processor", name)
            _processor_cache[name] = target() if isinstance(target, type) else target
    return _processor_cache[name]


def filter_probs(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Zero the probabilities that top_k / top_p / min_p exclude (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if info.need_top_k:
        ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        drop |= ranks >= info.top_ks.unsqueeze(1)
    if info.need_top_p:
        # drop a token when the mass strictly before it already reaches top_p
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= info.top_ps.unsqueeze(1)
    if info.need_min_p:
        drop |= sorted_probs < (sorted_probs[:, :1] * info.min_ps.unsqueeze(1))
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def exponential_noise(
    shape: tuple[int, int], info: SamplingBatchInfo, device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for row, seed, position in info.seeds:
        gen = torch.Generator(device=device)
        gen.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
        noise[row] = torch.empty(shape[1], device=device).exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Token ids ``[bs]`` for fp32 ``logits [bs, vocab]``."""
    greedy_ids = logits.argmax(dim=-1)
    if info.is_all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_k or info.need_top_p or info.need_min_p:
        probs = filter_probs(probs, info)
    sampled = (probs / exponential_noise(tuple(probs.shape), info, probs.device)).argmax(dim=-1)
    return torch.where(info.greedy, greedy_ids, sampled)
