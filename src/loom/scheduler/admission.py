"""The KV pages a set of requests can need at most, over all their future decode steps.

The scheduler admits a request when its expected pages fit (SGLang's ``new_token_ratio``
estimate, which may later force a retraction), or when this bound fits: then every admitted
request can run to its ``max_new_tokens`` with no retraction at all.

Request ``i`` holds ``tokens[i]`` tokens now, will grow by at most ``remaining[i]`` more, and
shares ``shared[i]`` of its pages with the prefix cache (those are not its to allocate). ``t``
decode steps from now it owns at most ``ceil((tokens[i] + t) / page_size) - shared[i]`` pages
while ``t <= remaining[i]``, and none once it has finished: its pages are freed, or handed to
the prefix cache, which may evict them. The sum over requests only grows between two
finishes, so its maximum is at some request's last step: with the requests sorted by
``remaining``, longest first, the ``k`` longest are the ones left at step ``remaining[k]``, and

    peak = max over k of  sum_{i <= k} (tokens[i] + page_size - 1 - page_size * shared[i])
                          + k * remaining[k],   in tokens, divided by page_size.

Summing the whole requests at their longest instead (what reserving each one's
``max_new_tokens`` would do) counts every short request at the longest one's step. For the
1000-request benchmark workload (prompts and outputs uniform in [100, 1,024] tokens, every
request running to its limit) that sum is ~1.13M tokens against a peak of ~0.68M.
"""

from __future__ import annotations

import numpy as np


def peak_pages(tokens: list[int], remaining: list[int], shared: list[int], page_size: int) -> int:
    """An upper bound on the pages the requests own together at any future step."""
    if not tokens:
        return 0
    rem = np.asarray(remaining, dtype=np.int64)
    base = (
        np.asarray(tokens, dtype=np.int64)
        + (page_size - 1)
        - page_size * np.asarray(shared, dtype=np.int64)
    )
    order = np.argsort(-rem, kind="stable")
    rem = rem[order]
    live = np.cumsum(base[order]) + np.arange(1, len(rem) + 1) * rem
    return -(-int(live.max()) // page_size)
