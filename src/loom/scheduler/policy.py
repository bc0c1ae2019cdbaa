"""The schedule_policy family: the order in which waiting requests are admitted.

Built-ins (``--schedule-policy``), after SGLang's:

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first, so requests that share a prefix run while it is cached;
  falls back to fcfs when the queue is longer than ``LPM_FALLBACK_QUEUE_LEN`` (matching every
  waiting request each step would cost more than it saves).
- ``dfs-weight``: walks the radix tree depth first, heaviest subtree (most waiting requests)
  first, so requests under the same prefix are admitted together; same fallback as lpm.
- ``lof``: longest output (``max_new_tokens``) first.
- ``random``: a seeded shuffle.
- ``priority``: the request's ``priority`` field, higher first, then arrival order.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from loom.scheduler.base import NoPrefixCache, PrefixView, SchedulePolicy

if TYPE_CHECKING:
    from loom.scheduler.request import Req

__all__ = ["NoPrefixCache", "PrefixView", "SchedulePolicy"]

LPM_FALLBACK_QUEUE_LEN = 128


class FCFSPolicy(SchedulePolicy):
    """First come, first served (arrival order)."""

    def order(self, waiting, cache):
        return list(waiting)


class LPMPolicy(SchedulePolicy):
    """Longest prefix match first (stable: ties keep arrival order)."""

    def order(self, waiting, cache):
        if len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            return list(waiting)
        lens = {id(r): cache.match(r)[0] for r in waiting}
        return sorted(waiting, key=lambda r: -lens[id(r)])


class DFSWeightPolicy(SchedulePolicy):
    """Depth-first over the radix tree, children by descending weight (the number of waiting
    requests whose match ends in their subtree); a node's own requests come before its
    children's. Requests with no match come last, in arrival order."""

    def order(self, waiting, cache):
        if len(waiting) > LPM_FALLBACK_QUEUE_LEN:
            return list(waiting)
        at: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, Any] = {}
        weight: dict[int, int] = defaultdict(int)
        unmatched = []
        for req in waiting:
            length, node = cache.match(req)
            if node is None or length == 0:
                unmatched.append(req)
                continue
            at[id(node)].append(req)
            while node is not None:
                nodes[id(node)] = node
                weight[id(node)] += 1
                node = node.parent
        roots = [n for n in nodes.values() if n.parent is None or id(n.parent) not in nodes]
        out: list[Req] = []
        stack = sorted(roots, key=lambda n: weight[id(n)])  # heaviest popped first
        while stack:
            node = stack.pop()
            out += at.get(id(node), [])
            kids = [c for c in node.children.values() if id(c) in weight]
            stack += sorted(kids, key=lambda n: weight[id(n)])
        return out + unmatched


class LOFPolicy(SchedulePolicy):
    """Longest output first (``max_new_tokens``); stable."""

    def order(self, waiting, cache):
        return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens)


class RandomPolicy(SchedulePolicy):
    """A shuffle from a generator seeded once (``--random-seed``), so runs repeat."""

    deterministic = False

    def __init__(self, seed: int = 0, **options: Any) -> None:
        super().__init__(seed=seed, **options)
        self.rng = random.Random(seed)

    def order(self, waiting, cache):
        out = list(waiting)
        self.rng.shuffle(out)
        return out


class PriorityPolicy(SchedulePolicy):
    """Higher ``priority`` first; arrival order among equals."""

    def order(self, waiting, cache):
        return sorted(waiting, key=lambda r: -r.priority)
