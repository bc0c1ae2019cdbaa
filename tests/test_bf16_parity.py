"""bf16 against HF transformers on the default model's trained weights: every greedy token that
HF's bf16 forward does not pick must be a near-tie in HF's own logits (bf16 rounding noise), not
a real disagreement. A bare agreement rate cannot separate the two: HF's bf16 disagrees with
itself on ~2% of these tokens across two kernel shapes (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

import loom
from loom.bench.offline import hf_model_for
from loom.bench.parity import flips, hf_logits, summarise_flips
from tests.conftest import CHAT_PROMPTS


@pytest.fixture(scope="module")
def bf16_run():
    with loom.Engine(dtype="bfloat16", max_total_tokens=4096) as e:
        prompts = [e.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
        outs = e.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
        )
        hf = hf_model_for(e)
    loom_out = [o["output_ids"] for o in outs]
    half = [hf_logits(hf, p, o) for p, o in zip(prompts, loom_out, strict=True)]
    hf32 = hf.float()
    full = [hf_logits(hf32, p, o) for p, o in zip(prompts, loom_out, strict=True)]
    return loom_out, half, full


def test_bf16_greedy_tokens_disagree_with_hf_only_on_near_ties(bf16_run):
    loom_out, half, full = bf16_run
    n = sum(len(o) for o in loom_out)
    rows = flips(loom_out, half, full, torch.bfloat16)
    summary = summarise_flips(rows)
    assert n == 8 * 64
    assert 1 - len(rows) / n >= 0.94, summary  # 96.3% on the project's CPU
    for r in rows:
        # within a few bf16 spacings of HF's own maximum (at most 2 on the project's CPU, 1 on
        # all but one flip), among its top 3, and within a fraction of a logit in fp32
        assert r["ulps_below_hf_max"] <= 3 and r["rank_in_hf"] <= 3, r
        assert abs(r["fp32_margin"]) < 0.5, r


def test_near_tie_check_catches_a_wrong_token(bf16_run):
    """The check above can fail: one token swapped for HF's second choice at a decisive position
    (a wide fp32 gap) is reported far from a tie."""
    loom_out, half, full = bf16_run
    i, j = max(
        ((i, j) for i in range(len(full)) for j in range(len(loom_out[i]))),
        key=lambda ij: (lambda t: float(t[0] - t[1]))(full[ij[0]][ij[1]].float().topk(2).values),
    )
    second = int(full[i][j].float().topk(2).indices[1])
    bad = [list(o) for o in loom_out]
    bad[i][j] = second
    rows = [
        r for r in flips(bad, half, full, torch.bfloat16) if (r["prompt"], r["position"]) == (i, j)
    ]
    assert len(rows) == 1 and rows[0]["fp32_margin"] < -0.5 and rows[0]["ulps_below_hf_max"] > 3
