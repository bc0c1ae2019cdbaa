"""One batch's sampling, from its logits to its tokens on the device.

``BatchSampler.sample(logits, rows)`` applies, in order: custom logits processors, penalties,
``min_new_tokens``, ``logit_bias``, the grammar mask, then temperature and top-k/top-p/min-p,
and draws (logprobs, when asked for, are of the raw logits). It owns what persists between
steps: the batch's sampling plan (its tensors, rebuilt only when the batch changes), the
penalty counts of every penalised request, and the pinned grammar-bitmask buffers.

On a GPU the fused Triton kernels apply penalties, bias and the grammar mask inside the draw
(one launch a step); an all-greedy grammar batch without penalties or bias takes
``masked_argmax`` (PyTorch launches only). Elsewhere each step is its own PyTorch operation and
the grammar library's kernel applies its mask.

A row is duck-typed: ``rid``, ``sampling_params``, ``origin_input_ids``, ``output_ids``,
``is_finished``, ``grammar``, ``penalty_row`` (set here), ``processor_params`` (set by an SGLang
processor, ``sglang_processor.py``), ``return_logprob`` and ``top_logprobs_num``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.sampling.penalties import PenaltyState, apply_penalties
from loom.sampling.sampler import (
    SamplingBatchInfo,
    apply_logits_processors,
    masked_argmax,
    sample,
)
from loom.sampling.triton_sampling import FusedPenalties, fused_sample
from loom.sampling.triton_sampling import enabled as fused_sampling_enabled


@dataclass
class Sampled:
    """One step's sampled ids (and, when asked for, their logprobs) on the device."""

    tokens: torch.Tensor  # [bs]
    logprobs: torch.Tensor | None = None  # [bs] log_softmax of the raw logits at the token
    top_values: torch.Tensor | None = None  # [bs, k]
    top_ids: torch.Tensor | None = None  # [bs, k]
    # [bs, m]: row i's first len(token_ids_logprob) entries are those ids' logprobs
    token_ids_values: torch.Tensor | None = None


@dataclass
class _Plan:
    """One batch's sampling tensors on the device (see ``BatchSampler._plan``)."""

    key: tuple
    info: SamplingBatchInfo
    seeded: list[int]  # rows with a sampling_seed
    want_logprobs: bool
    has_grammar: bool
    penalties: tuple | None = None  # see _build_plan
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # flat (row * vocab + token), values
    # On a GPU: penalties, bias and the grammar mask applied by the sampling kernel itself
    fused: FusedPenalties | None = None
    masked_argmax: bool = False  # an all-greedy grammar batch: sampler.masked_argmax


class BatchSampler:
    """``eos_token_ids``: blocked while a row is under its ``min_new_tokens``. ``grammar_backend``
    returns the grammar backend (asked only for batches with a grammar). ``on_error(row,
    exc)``: a row whose processor or grammar matcher failed (its request fails alone).
    ``max_rows``: the largest batch (sizes the pinned bitmask buffers). ``stats``: an object
    whose ``time_grammar_mask_s`` counts the host time of bitmask fills."""

    def __init__(
        self,
        eos_token_ids: set[int],
        max_rows: int,
        grammar_backend: Callable[[], object],
        on_error: Callable[[object, BaseException], None],
        stats,
        close_within_budget: Callable[..., None] | None = None,
    ) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_rows = max_rows
        self.grammar_backend = grammar_backend
        self.on_error = on_error
        self.stats = stats
        # (reqs, rows, mask, out_lens): narrows the filled grammar rows of requests about to
        # run out of tokens (``constrained/closing.py``)
        self.close_within_budget = close_within_budget
        self.penalties: PenaltyState | None = None  # allocated with the first penalised row
        self._plan_cache: _Plan | None = None
        self._mask_bufs: list[torch.Tensor] | None = None  # pinned grammar bitmasks (CUDA)
        self._mask_flip = 0

    def reset(self) -> None:
        """Forget the cached plan (its rows are gone: a failed step, the warm-up's end)."""
        self._plan_cache = None

    def release(self, req) -> None:
        """The row's penalty counts are no longer needed (its request ended)."""
        if req.penalty_row is not None:
            self.penalties.release(req.penalty_row)
            req.penalty_row = None

    def sample(self, logits: torch.Tensor, reqs: list, pending: int | list[int] = 0) -> Sampled:
        """Sampled ids on the device (no host sync); ``pending`` tokens (per row, or the same for
        every row) are sampled but not yet appended (overlap), which shifts output positions."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        params = [r.sampling_params for r in reqs]
        if isinstance(pending, int):
            out_lens = [len(r.output_ids) + pending for r in reqs]
        else:
            out_lens = [len(r.output_ids) + k for r, k in zip(reqs, pending, strict=True)]
        plan = self._plan(logits, reqs, params, out_lens)
        info = plan.info
        want_lp = plan.want_logprobs
        raw = logits.clone() if want_lp else None
        if info.processors:
            logits = apply_logits_processors(
                logits, info, reqs, lambda row, e: self.on_error(reqs[row], e)
            )
        if plan.masked_argmax:
            tokens = masked_argmax(logits, self._grammar_masks(logits, reqs, out_lens))
            return _finish(tokens, raw, reqs, want_lp)
        if plan.fused is not None:
            # Fused kernels: penalties, bias, the grammar's mask (its -inf entries stay -inf
            # under all of them), the draw, and the counts of the drawn tokens.
            mask = self._grammar_masks(logits, reqs, out_lens) if plan.has_grammar else None
            tokens = fused_sample(
                logits,
                info.params,
                info.seeds,
                extras=plan.fused,
                state=self.penalties,
                vocab_mask=mask,
                greedy_only=info.is_all_greedy,
                search=info.need_top_k or info.need_top_p,
            )
            return _finish(tokens, raw, reqs, want_lp)
        if plan.penalties is not None:
            batch_rows, state_rows, coef, row_base, ones, all_rows = plan.penalties
            apply_penalties(logits, batch_rows, state_rows, self.penalties, *coef.unbind(0))
        if plan.bias is not None:
            flat, v = plan.bias
            logits.view(-1).index_add_(0, flat, v)  # atomic adds: no sort, no sync
        if plan.has_grammar:
            mask = self._grammar_masks(logits, reqs, out_lens)
            self.grammar_backend().apply_vocab_mask(logits, mask)
        tokens = sample(logits, info)
        if plan.penalties is not None:
            picked = tokens if all_rows else tokens.index_select(0, batch_rows)
            self.penalties.add(state_rows, picked, row_base, ones)
        return _finish(tokens, raw, reqs, want_lp)

    # ---- the plan -------------------------------------------------------------------------

    def _plan(self, logits, reqs, params, out_lens) -> _Plan:
        """The batch's sampling tensors (per-row parameters, penalty rows and coefficients,
        logit-bias and min_new_tokens entries), built once and reused while the batch stays the
        same: in steady decode a step then does no per-request Python and no host-to-device
        copy for sampling. Only seeded rows' output positions change from step to step."""
        key = (
            logits.shape[-1],
            logits.device,
            tuple(
                (r.rid, r.is_finished, n < p.min_new_tokens)
                for r, p, n in zip(reqs, params, out_lens, strict=True)
            ),
        )
        plan = self._plan_cache
        if plan is None or plan.key != key:
            plan = self._plan_cache = self._build_plan(key, logits, reqs, params, out_lens)
        if plan.seeded:
            plan.info.seeds = [(i, params[i].sampling_seed, out_lens[i]) for i in plan.seeded]
        return plan

    def _build_plan(self, key, logits, reqs, params, out_lens) -> _Plan:
        dev = logits.device
        vocab = logits.shape[-1]
        pen = [i for i, p in enumerate(params) if p.has_penalties and not reqs[i].is_finished]
        bias_rows = [
            i for i, (p, n) in enumerate(zip(params, out_lens, strict=True))
            if n < p.min_new_tokens or p.logit_bias
        ]  # fmt: skip
        has_grammar = any(r.grammar is not None and not r.is_finished for r in reqs)
        fused = (pen or bias_rows or has_grammar) and fused_sampling_enabled(logits)
        greedy = all(p.is_greedy for p in params)
        masked = fused and not (pen or bias_rows) and greedy
        fused = fused and not masked
        info = SamplingBatchInfo.build(params, out_lens, vocab, dev, with_params=fused)
        plan = _Plan(
            key=key,
            info=info,
            seeded=[i for i, p in enumerate(params) if p.sampling_seed is not None],
            want_logprobs=any(r.return_logprob for r in reqs),
            has_grammar=has_grammar,
            masked_argmax=masked,
        )
        if pen:
            if self.penalties is None:
                self.penalties = PenaltyState(logits.shape[-1], dev)
            for i in pen:
                if reqs[i].penalty_row is None:
                    reqs[i].penalty_row = self.penalties.alloc(reqs[i].origin_input_ids)
        if fused:
            plan.fused = self._fused_penalties(reqs, params, out_lens, pen, bias_rows, dev)
            return plan
        if pen:
            coef = torch.tensor(
                [
                    [float(params[i].frequency_penalty) for i in pen],
                    [float(params[i].presence_penalty) for i in pen],
                    [float(params[i].repetition_penalty) for i in pen],
                ],
                dtype=logits.dtype,
            ).to(dev, non_blocking=True)
            idx = torch.tensor([pen, [reqs[i].penalty_row for i in pen]], dtype=torch.int64).to(
                dev, non_blocking=True
            )
            # (batch rows, state rows, coefficients, state rows x vocab, ones, every row?)
            plan.penalties = (
                idx[0],
                idx[1],
                coef,
                idx[1] * logits.shape[-1],
                torch.ones(len(pen), dtype=torch.int32, device=dev),
                len(pen) == len(params),
            )
        biases = self._row_biases(params, out_lens, bias_rows)
        if biases:
            flat = torch.tensor([i * vocab + t for i, row in biases.items() for t in row])
            vals = [b for row in biases.values() for b in row.values()]
            v = torch.tensor(vals, dtype=logits.dtype).to(dev, non_blocking=True)
            plan.bias = (flat.to(dev, non_blocking=True), v)
        return plan

    def _row_biases(self, params, out_lens, rows) -> dict[int, dict[int, float]]:
        """Batch row -> token -> what is added to its logit: ``logit_bias``, and -inf for EOS
        and ``stop_token_ids`` while fewer than ``min_new_tokens`` have been generated."""
        out = {}
        for i in rows:
            p, row = params[i], {}
            for t, b in (p.logit_bias or {}).items():
                row[int(t)] = float(b)
            if out_lens[i] < p.min_new_tokens:
                for t in self.eos_token_ids | set(p.stop_token_ids):
                    row[t] = float("-inf")
            out[i] = row
        return out

    def _fused_penalties(self, reqs, params, out_lens, pen, bias_rows, dev) -> FusedPenalties:
        """The plan's penalty rows and coefficients and its logit bias (with min_new_tokens'
        -inf entries) as the fused sampling kernel takes them."""
        bs = len(params)
        state_rows = coef = bias = None
        if pen:
            state_rows = [-1] * bs
            coef = [[0.0] * bs, [0.0] * bs, [1.0] * bs]
            for i in pen:
                p = params[i]
                state_rows[i] = reqs[i].penalty_row
                coef[0][i] = float(p.frequency_penalty)
                coef[1][i] = float(p.presence_penalty)
                coef[2][i] = float(p.repetition_penalty)
        if bias_rows:
            biases = self._row_biases(params, out_lens, bias_rows)
            bias = [biases.get(i, {}) for i in range(bs)]
        return FusedPenalties.build(state_rows, coef, bias, dev)

    # ---- grammar masks --------------------------------------------------------------------

    def _grammar_masks(self, logits: torch.Tensor, reqs: list, out_lens: list[int]) -> torch.Tensor:
        """The step's grammar bitmask on ``logits``' device, filled on the host (on a GPU this
        overlaps the forward pass just launched) and copied without a sync."""
        t = time.perf_counter()
        backend = self.grammar_backend()
        mask = self._host_vocab_mask(backend, len(reqs), logits.device)
        # (a request that finished while this step's forward ran keeps an unmasked row; its
        # token is discarded)
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None and not req.is_finished]
        try:
            backend.fill_vocab_masks([reqs[i].grammar for i in rows], mask, rows)
        except Exception:  # noqa: BLE001 - find the matcher that failed; fail its request alone
            for i in rows:
                try:
                    reqs[i].grammar.fill_vocab_mask(mask, i)
                except Exception as e:  # noqa: BLE001
                    self.on_error(reqs[i], e)
        if self.close_within_budget is not None:
            rows = [i for i in rows if not reqs[i].is_finished]
            self.close_within_budget(reqs, rows, mask, out_lens)
        mask = mask.to(logits.device, non_blocking=True)
        self.stats.time_grammar_mask_s += time.perf_counter() - t
        return mask

    def _host_vocab_mask(self, backend, bs: int, device: torch.device) -> torch.Tensor:
        """The host bitmask for this step. On CUDA: alternate halves of two pinned buffers, so
        the copy to the device is asynchronous and a buffer is refilled only after the step
        that copied it was resolved (two steps later)."""
        if device.type != "cuda":
            return backend.allocate_vocab_mask(bs)
        bufs = self._mask_bufs
        if bufs is None or bufs[0].shape[0] < bs:
            proto = backend.allocate_vocab_mask(1)
            cap = max(bs, self.max_rows)
            bufs = self._mask_bufs = [
                torch.empty((cap, proto.shape[1]), dtype=proto.dtype, pin_memory=True)
                for _ in range(2)
            ]
        self._mask_flip ^= 1
        mask = bufs[self._mask_flip][:bs]
        backend.reset_vocab_mask(mask)
        return mask


def _finish(tokens, raw, reqs, want_lp) -> Sampled:
    out = Sampled(tokens)
    if want_lp:
        lsm = torch.log_softmax(raw.float(), dim=-1)
        out.logprobs = lsm.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(r.top_logprobs_num for r in reqs)
        if k > 0:
            out.top_values, out.top_ids = lsm.topk(k, dim=-1)
        chosen = [r.token_ids_logprob or () for r in reqs]
        m = max(map(len, chosen))
        if m:
            ids = torch.tensor([list(c) + [0] * (m - len(c)) for c in chosen])
            out.token_ids_values = lsm.gather(1, ids.to(lsm.device, non_blocking=True))
    return out
