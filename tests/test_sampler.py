"""The sampler against formulas: greedy, filtered distributions, seeds."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loom.sampling.sampler import SamplingBatchInfo, filter_probs, sample
from loom.sampling.sampling_params import SamplingParams


def _info(params, vocab=8, output_lens=None):
    return SamplingBatchInfo.build(
        params, output_lens or [0] * len(params), vocab, torch.device("cpu")
    )


def _reference_filtered(logits, temperature, top_k, top_p, min_p):
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if top_k > 0 and rank >= top_k:
            break
        if mass >= top_p:
            break
        if probs[idx] < min_p * probs[order[0]]:
            break
        keep[idx] = True
        mass += probs[idx].item()
    p = torch.where(keep, probs, 0)
    return p / p.sum()


def test_greedy_rows_take_argmax():
    logits = torch.randn(3, 8)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0)]
    assert sample(logits, _info(params)).tolist() == logits.argmax(-1).tolist()


def test_filter_matches_formula():
    torch.manual_seed(0)
    logits = torch.randn(4, 8) * 2
    settings = [(0.7, 3, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (1.0, -1, 1.0, 0.2), (0.9, 5, 0.6, 0.05)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    info = _info(params)
    probs = torch.softmax(logits / info.temperatures, -1)
    got = filter_probs(probs, info)
    for row, (t, k, p, m) in enumerate(settings):
        ref = _reference_filtered(logits[row], t, k, p, m)
        torch.testing.assert_close(got[row] / got[row].sum(), ref)


def test_sample_frequencies_follow_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]])
    params = [SamplingParams(temperature=0.8, top_k=4)]
    n = 20000
    info = _info(params * n)
    draws = sample(logits.expand(n, -1).clone(), info)
    counts = torch.bincount(draws, minlength=8).float()
    ref = _reference_filtered(logits[0], 0.8, 4, 1.0, 0.0)
    expected = ref * n
    mask = expected > 0
    assert counts[~mask].sum() == 0  # nothing outside top_k
    chi2 = (((counts[mask] - expected[mask]) ** 2) / expected[mask]).sum().item()
    assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_seeded_rows_are_reproducible_across_batches():
    torch.manual_seed(1)
    logits = torch.randn(1, 64)
    seeded = SamplingParams(temperature=1.0, sampling_seed=42)
    alone = [sample(logits, _info([seeded], 64, [i])).item() for i in range(20)]
    other = SamplingParams(temperature=1.0)
    batch = torch.cat([torch.randn(1, 64), logits, torch.randn(1, 64)])
    in_batch = [
        sample(batch, _info([other, seeded, other], 64, [0, i, 0]))[1].item() for i in range(20)
    ]
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions draw different noise


def test_engine_seed_gives_same_text_alone_and_batched(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}
    alone = engine.generate("Once upon a time", params)["output_ids"]
    batched = engine.generate(
        ["Tell me a joke", "Once upon a time", "Hi"],
        [{"max_new_tokens": 12, "temperature": 1.0}, params, {"max_new_tokens": 5}],
    )
    assert batched[1]["output_ids"] == alone


@pytest.mark.parametrize("vocab", [128256, 49152, 8192])
def test_two_stage_argmax_is_argmax_with_ties(vocab):
    """The GPU's two-stage argmax returns torch.argmax's index, the first maximum, on ties too."""
    from loom.sampling.sampler import _vocab_split, argmax_two_stage

    torch.manual_seed(0)
    c = _vocab_split(vocab)
    assert c > 1 and vocab % c == 0
    logits = torch.randn(6, vocab)
    logits[1, 7] = logits[1, vocab - 3] = 50.0  # a tie across chunks
    logits[2, 100] = logits[2, 101] = 50.0  # a tie within a chunk
    logits[3] = 0.0  # all equal
    logits[4, vocab - 1] = 99.0  # the last entry
    assert torch.equal(argmax_two_stage(logits, c), logits.argmax(dim=-1))
    assert argmax_two_stage(logits, c)[1] == 7 and argmax_two_stage(logits, c)[3] == 0


# ---- the fused GPU sampling kernel (CPU: Triton's interpreter) ----------------------------------

_FUSED_LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.2, -0.5, -1.0, -3.0, 0.9, 1.1, -0.1, 0.0])


def _fused_draws(params, n, seeds=None, logits=None):
    from loom.sampling.triton_sampling import fused_sample

    logits = _FUSED_LOGITS if logits is None else logits
    info = _info(params * n if len(params) == 1 else params, vocab=logits.shape[0])
    rows = logits.expand(len(info.params[0]), -1).clone()
    # 12 halvings of their range (6) resolve these logits (>= 0.1 apart): a fast interpreter run
    return fused_sample(rows, info.params, seeds if seeds is not None else info.seeds, iters=12)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize(
    "t,k,p,m",
    [(0.7, 3, 1.0, 0.0), (1.0, -1, 0.8, 0.0), (1.3, 5, 0.9, 0.05), (1.0, -1, 1.0, 0.3)],
)  # fmt: skip
def test_fused_kernel_samples_follow_the_filtered_softmax(t, k, p, m):
    from tests.test_sampling_params import _chi2_p

    n = 800
    draws = _fused_draws([SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)], n)
    counts = torch.bincount(draws, minlength=len(_FUSED_LOGITS)).double()
    want = _reference_filtered(_FUSED_LOGITS, t, k if k > 0 else 0, p, m)
    expected = want / want.sum() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a filtered-out token was sampled"
    assert _chi2_p(counts[keep], expected[keep]) > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_fused_kernel_greedy_rows_masks_and_seeds():
    logits = _FUSED_LOGITS.clone()
    logits[0] = float("-inf")  # a grammar mask: never drawn
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.95)] * 60
    draws = _fused_draws(params, 1, logits=logits)
    assert (draws[0::2] == logits.argmax()).all()  # greedy rows: the first maximum
    assert (draws != 0).all()
    assert len(set(draws[1::2].tolist())) > 3  # sampled rows vary
    seeded = [SamplingParams(temperature=1.0, sampling_seed=7)] * 4
    a = _fused_draws(seeded, 1, seeds=[(i, 7, 5) for i in range(4)])
    b = _fused_draws(seeded, 1, seeds=[(i, 7, 5) for i in range(4)])
    assert torch.equal(a, b) and len(set(a.tolist())) == 1  # same seed and position: same draw
