"""The admission bound (``loom.scheduler.admission.peak_pages``) against a step-by-step count of
the pages a set of requests owns, and the scheduler admitting by it."""

from __future__ import annotations

import random

import pytest

from loom.scheduler.admission import peak_pages


def _counted_peak(tokens, growth, shared, page_size):
    """The pages owned at each future step, counted one step at a time (the oracle)."""
    best = 0
    for t in range(max(growth) + 1):
        owned = sum(
            -(-(n + t) // page_size) - s
            for n, g, s in zip(tokens, growth, shared, strict=True)
            if t <= g
        )
        best = max(best, owned)
    return best


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_peak_pages_bounds_the_counted_peak(page_size):
    """Never below the counted peak, and above it by at most a page a request (the bound rounds
    each request's tokens up to a page without knowing where its pages end)."""
    rng = random.Random(page_size)
    for _ in range(200):
        n = rng.randint(1, 12)
        tokens = [rng.randint(1, 300) for _ in range(n)]
        growth = [rng.randint(0, 200) for _ in range(n)]
        shared = [rng.randint(0, (t - 1) // page_size) for t in tokens]
        counted = _counted_peak(tokens, growth, shared, page_size)
        bound = peak_pages(tokens, growth, shared, page_size)
        assert counted <= bound <= counted + n, (tokens, growth, shared)


def test_peak_pages_is_below_the_sum_of_whole_requests():
    # two requests: one short-lived, one long; the short one is gone before the long one peaks
    assert peak_pages([100, 100], [10, 500], [0, 0], 1) == max(100 + 500, 2 * (100 + 10))
    assert peak_pages([], [], [], 16) == 0
