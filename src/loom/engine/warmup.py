"""The start-up warm-up: a few throwaway requests through the paths a first request takes, so
that Triton compiles its kernels now and not inside the first requests (on the H200 the first
sampled requests paid 2-5 s, docs/benchmarks.md)."""

from __future__ import annotations

import torch

from loom.layers.fused_ops import ROTARY_GROUPED_FROM
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.request import Req

# Sampling parameters of the warm-up's rounds: each round is its own batch, so each takes its
# own path (argmax; fused kernels with and without the top-p search; with penalties and logit
# bias; min_new_tokens' bias rows; seeded rows, which draw from their own seeds).
ROUNDS = (
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 0.7},
    {
        "temperature": 0.8,
        "top_p": 0.95,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {"3": -1.0},
    },
    {"temperature": 0.0, "min_new_tokens": 2},
    {"temperature": 0.7, "top_p": 0.9, "seed": 1},
)


@torch.inference_mode()
def warm_up(sched) -> None:
    """Prompts of 16, 21 and 1 tokens cover the three ways Triton specialises a token count (a
    multiple of 16, neither, one); one past the rotary kernel's switch to head groups covers its
    prefill variant (a first 124-token request compiled it on the H200: +118 ms); the rounds
    cover the sampling paths. Afterwards the prefix cache is empty, every page is free and the
    scheduler's counters start from zero."""
    vocab = sched.runner.vocab_size
    greedy = {"temperature": 0.0}
    rounds = [(16, greedy), (1, greedy), (ROTARY_GROUPED_FROM + 5, greedy)]
    rounds += [(21, extra) for extra in ROUNDS]
    with sched.cache.without_tree():
        _run(sched, rounds, vocab)
        lora = sched.lora.manager
        if lora is not None and lora.device.type == "cuda":
            # The LoRA kernels outside the graphs (prefill, mixed steps) specialise on their
            # token tile (runs of 1-16, 17-32, longer) and the gather expand on whether a step
            # has more than SPLIT_CHUNK splits: a first 8B batch of 64 x 128-token prompts on
            # adapters paid 2.4 s compiling them on the H200.
            with lora.warmup_adapter() as ref:
                _run(sched, [(n, greedy) for n in (1, 16, 21, 40, 130)], vocab, ref)
    sched.reset_after_warmup()


def _run(sched, rounds, vocab: int, lora=None) -> None:
    """Each round's two requests together, to the end (``lora``: the adapter they run on)."""
    for i, (n, extra) in enumerate(rounds):
        for j in range(2):
            ids = [(7 + 13 * (k + j)) % vocab for k in range(n)]
            params = SamplingParams.from_dict({"max_new_tokens": 3, "ignore_eos": True, **extra})
            params.validate(vocab)
            rid = f"loom-warmup-{'lora-' if lora else ''}{i}-{j}"
            names = (lora.lora_name, lora.lora_id) if lora else (None, None)
            sched.add_request(Req(rid, ids, params, 0, None, *names))
        while sched.has_work:
            sched.step()
