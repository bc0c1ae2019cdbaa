"""Comparing Loom's greedy tokens with HF transformers' choices in half precision.

In bf16 two correct forwards of the same model disagree on a few percent of greedy tokens: a
logit carries 8 significant bits (spacing 0.125 at 16-32), so near-tied candidates swap with the
order of a kernel's sums, and exact ties are broken by index. HF disagrees with itself this way
across two kernel shapes (its cached ``generate()`` against one long forward). A bare agreement
rate cannot tell that noise from a real error; looking at each disagreement can: noise is a
near-tie in HF's own logits, an error is not. (vLLM's HF comparisons accept a mismatch when each
token is in the other's top few for the same reason.)
"""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_logits(model, prompt: list[int], out: list[int], device=None) -> torch.Tensor:
    """HF's logits (in the model's dtype) before each token of ``out``: the prompt and ``out``
    in one forward ("teacher-forced", so one early flip does not cascade)."""
    ids = torch.tensor([prompt + out], device=device)
    return model(input_ids=ids).logits[0, len(prompt) - 1 : -1]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s values at ``x`` (one unit in the last place)."""
    eps = torch.finfo(dtype).eps  # 2 ** -(mantissa bits)
    return torch.exp2(torch.floor(torch.log2(x.abs().float().clamp_min(1e-30)))) * eps


def flips(
    outs: list[list[int]],
    half_logits: list[torch.Tensor],
    fp32_logits: list[torch.Tensor],
    dtype: torch.dtype,
) -> list[dict]:
    """Each token of ``outs`` that HF's half-precision argmax did not pick: how far it lies below
    HF's maximum in HF's own logits, in units of ``dtype``'s spacing there (0: an exact tie,
    broken by index), its rank among HF's logits, and the fp32 margin between the two tokens
    (positive: fp32 prefers the token Loom chose)."""
    rows = []
    for i, (out, lh, l32) in enumerate(zip(outs, half_logits, fp32_logits, strict=True)):
        for j, tok in enumerate(out):
            top = int(lh[j].argmax())
            if top == tok:
                continue
            mx = lh[j, top].float()
            rows.append(
                {
                    "prompt": i,
                    "position": j,
                    "ulps_below_hf_max": float((mx - lh[j, tok].float()) / ulp(mx, dtype)),
                    "rank_in_hf": int((lh[j] > lh[j, tok]).sum()) + 1,
                    "fp32_margin": float(l32[j, tok].float() - l32[j, top].float()),
                }
            )
    return rows


def summarise_flips(rows: list[dict]) -> dict:
    return {
        "flips": len(rows),
        "flips_tied_in_hf": sum(r["ulps_below_hf_max"] == 0 for r in rows),
        "flips_within_one_ulp": sum(r["ulps_below_hf_max"] <= 1 for r in rows),
        "flips_max_ulps_below_hf_max": max((r["ulps_below_hf_max"] for r in rows), default=0.0),
        "flips_max_rank_in_hf": max((r["rank_in_hf"] for r in rows), default=0),
        "flips_max_abs_fp32_margin": max((abs(r["fp32_margin"]) for r in rows), default=0.0),
        "flips_loom_nearer_fp32": sum(r["fp32_margin"] > 0 for r in rows),
    }
