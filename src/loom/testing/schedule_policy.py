"""Conformance kit of the schedule_policy family."""

from __future__ import annotations

import random

from loom.testing._common import instantiate


class _FakePrefixNode:
    def __init__(self, parent=None):
        self.parent, self.children = parent, {}
        if parent is not None:
            parent.children[len(parent.children)] = self


class _FakePrefixView:
    """A small random tree; each request matches a random node of it (or nothing)."""

    def __init__(self, rng: random.Random) -> None:
        root = _FakePrefixNode()
        self.nodes = [root]
        for _ in range(6):
            self.nodes.append(_FakePrefixNode(rng.choice(self.nodes)))
        self.rng = rng
        self.memo: dict[str, tuple[int, object]] = {}

    def match(self, req):
        if req.rid not in self.memo:
            node = self.rng.choice(self.nodes)
            self.memo[req.rid] = (
                (0, None)
                if node.parent is None
                else (
                    self.rng.randint(1, 20),
                    node,
                )
            )
        return self.memo[req.rid]


def check_schedule_policy(name: str, seed: int = 0) -> None:
    """``order`` returns a permutation of the queue and leaves requests untouched."""
    from loom.sampling.sampling_params import SamplingParams
    from loom.scheduler.request import Req

    rng = random.Random(seed)
    policy = instantiate("schedule_policy", name)
    for size in (0, 1, 7, 40):
        waiting = [
            Req(
                f"r{i}",
                [rng.randrange(100) for _ in range(rng.randint(1, 20))],
                SamplingParams(max_new_tokens=rng.randint(1, 50)),
            )
            for i in range(size)
        ]
        before = [
            (r.rid, list(r.origin_input_ids), r.sampling_params.max_new_tokens) for r in waiting
        ]
        ordered = policy.order(list(waiting), _FakePrefixView(rng))
        assert sorted(map(id, ordered)) == sorted(map(id, waiting)), (
            f"{name}: order() must return a permutation of the waiting requests"
        )
        after = [
            (r.rid, list(r.origin_input_ids), r.sampling_params.max_new_tokens) for r in waiting
        ]
        assert before == after, f"{name}: order() must not mutate requests"
