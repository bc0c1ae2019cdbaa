"""The random workloads the benchmarks share (no torch: load-generator workers import this)."""

from __future__ import annotations

import random


def make_requests(
    num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    """``num`` (prompt ids, output length) pairs, lengths uniform in [len * ratio, len]."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * ratio)), output_len)
        # Avoid the first ids, which are special tokens in most vocabularies.
        reqs.append(([rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n_in)], n_out))
    return reqs


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at ``rate`` requests per second,
    or all at 0 for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out
