"""Penalties, logit bias and min_new_tokens for a whole batch, on the device.

Per-request token counts live in one ``[rows, vocab]`` tensor (``PenaltyState``); a request that
uses a penalty owns a row from its first sampled token until it finishes, so the batch's view is
an index of rows: requests joining or leaving the batch change the index, never the counts
(SGLang's filter/merge, without copies). Counts are updated on the device from the sampled
token tensor, so nothing waits for the host, also under overlap scheduling.

Semantics (the references in tests/test_sampling.py):
- ``frequency_penalty`` f, ``presence_penalty`` p (OpenAI): ``logit -= f * count + p * (count >
  0)`` over the tokens generated so far;
- ``repetition_penalty`` r (HF ``RepetitionPenaltyLogitsProcessor``): for tokens in the prompt or
  the output, ``logit / r`` if positive else ``logit * r``;
- ``logit_bias``: added to the logit; ``min_new_tokens``: EOS and ``stop_token_ids`` get -inf
  until that many tokens have been generated.
"""

from __future__ import annotations

import importlib.util

import torch

from loom import env


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.free = list(range(capacity - 1, -1, -1))
        self.prompt_ids: dict[int, torch.Tensor] = {}  # row -> unique prompt ids (CPU path)

    def alloc(self, prompt_ids: list[int]) -> int:
        if not self.free:
            n = self.counts.shape[0]
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        row = self.free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        ids_cpu = torch.tensor(prompt_ids, dtype=torch.int64)
        self.in_prompt[row, ids_cpu.to(self.device, non_blocking=True)] = True
        if self.device.type == "cpu":  # the sparse CPU path's list (unique on a device syncs)
            self.prompt_ids[row] = torch.unique(ids_cpu)
        return row

    def release(self, row: int) -> None:
        self.free.append(row)

    def add(
        self,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        row_base: torch.Tensor | None = None,
        ones: torch.Tensor | None = None,
    ) -> None:
        """Count one sampled token per row (device tensors). ``row_base`` (``rows * vocab``)
        and ``ones`` may be passed in precomputed (a batch reuses them step after step)."""
        # index_add_ on the flat view: atomic adds (index_put_ with accumulate sorts first)
        if row_base is None:
            row_base = rows * self.counts.shape[1]
        if ones is None:
            ones = torch.ones_like(tokens, dtype=torch.int32)
        self.counts.view(-1).index_add_(0, row_base + tokens, ones)


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def penalised(x, counts, in_prompt, freq, pres, rep):
        """The penalties on a block of fp32 logits: ``counts`` of output tokens (fp32),
        ``in_prompt`` flags; frequency and presence first, then repetition (HF's rule) on
        tokens seen in the prompt or the output. Shared with the fused sampling kernel."""
        seen_out = counts > 0
        x = x - freq * counts - pres * seen_out.to(tl.float32)
        return tl.where(seen_out | (in_prompt != 0), tl.where(x > 0, x / rep, x * rep), x)

    @triton.jit
    def _penalties_kernel(
        Logits,
        BatchRows,
        StateRows,
        Counts,
        InPrompt,
        Freq,
        Pres,
        Rep,
        stride_l,
        stride_c,
        stride_p,
        V,
        BLOCK: tl.constexpr,
    ):
        # One program per (penalised row, block of the vocabulary): frequency and presence
        # penalties, then repetition, in one pass (the plain-PyTorch path is ~12 kernels).
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        b = tl.load(BatchRows + i)
        s = tl.load(StateRows + i)
        x = tl.load(Logits + b * stride_l + cols, mask=mask, other=0.0)
        c = tl.load(Counts + s * stride_c + cols, mask=mask, other=0).to(tl.float32)
        p = tl.load(InPrompt + s * stride_p + cols, mask=mask, other=0)
        x = penalised(x, c, p, tl.load(Freq + i), tl.load(Pres + i), tl.load(Rep + i))
        tl.store(Logits + b * stride_l + cols, x, mask=mask)


def _use_kernel(logits: torch.Tensor) -> bool:
    return importlib.util.find_spec("triton") is not None and (
        logits.is_cuda or env.triton_interpreter()
    )


def _apply_kernel(logits, batch_rows, state_rows, state, freq, pres, rep) -> None:
    """``_apply_dense`` as one Triton kernel (fp32 logits, in place)."""
    m, vocab = batch_rows.shape[0], logits.shape[-1]
    if m == 0:
        return
    block = 4096
    _penalties_kernel[(m, triton.cdiv(vocab, block))](
        logits,
        batch_rows,
        state_rows,
        state.counts,
        state.in_prompt.view(torch.int8),
        freq.contiguous(),
        pres.contiguous(),
        rep.contiguous(),
        logits.stride(0),
        state.counts.stride(0),
        state.in_prompt.stride(0),
        vocab,
        BLOCK=block,
    )


def apply_penalties(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    state_rows: torch.Tensor,
    state: PenaltyState,
    freq: torch.Tensor,
    pres: torch.Tensor,
    rep: torch.Tensor,
) -> None:
    """In place on ``logits[batch_rows]``; per-row coefficients are ``[m]`` tensors."""
    if logits.device.type == "cpu":
        fn = _apply_sparse
    elif logits.dtype == torch.float32 and logits.stride(1) == 1 and _use_kernel(logits):
        fn = _apply_kernel
    else:
        fn = _apply_dense
    fn(logits, batch_rows, state_rows, state, freq, pres, rep)


def _apply_dense(logits, batch_rows, state_rows, state, freq, pres, rep) -> None:
    """Whole rows, no data-dependent shapes: no host sync (CUDA, CUDA graphs)."""
    sub = logits.index_select(0, batch_rows)
    counts = state.counts.index_select(0, state_rows)
    seen_out = counts > 0
    sub = (
        sub - freq.unsqueeze(1) * counts.to(sub.dtype) - pres.unsqueeze(1) * seen_out.to(sub.dtype)
    )
    seen = seen_out | state.in_prompt.index_select(0, state_rows)
    r = rep.unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    logits.index_copy_(0, batch_rows, sub)


def _apply_sparse(logits, batch_rows, state_rows, state, freq, pres, rep) -> None:
    """The same on CPU, touching only the tokens a request has seen (a device would need a
    host sync for ``nonzero``; a CPU does not, and skips ~10 passes over [rows, vocab])."""
    vocab = logits.shape[-1]
    counts = state.counts.index_select(0, state_rows)
    r, c = counts.nonzero(as_tuple=True)
    v = counts[r, c].to(logits.dtype)
    logits.index_put_((batch_rows[r], c), -(freq[r] * v + pres[r] * (v > 0)), accumulate=True)
    if bool((rep != 1).any()):
        prompts = [state.prompt_ids[s] for s in state_rows.tolist()]
        pr = torch.cat([torch.full((len(p),), i, dtype=torch.int64) for i, p in enumerate(prompts)])
        key = torch.unique(torch.cat([r * vocab + c, pr * vocab + torch.cat(prompts)]))
        rr, cc = key // vocab, key % vocab
        bb = batch_rows[rr]
        x = logits[bb, cc]
        rp = rep[rr]
        logits[bb, cc] = torch.where(x > 0, x / rp, x * rp)
