"""Conformance kit of the radix_eviction_policy family."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

from loom.testing._common import instantiate


@dataclass
class FakeNode:
    """What the radix cache exposes to an eviction policy."""

    creation_time: float
    last_access_time: float
    hit_count: int
    priority: int = 0


def check_radix_eviction_policy(name: str, seed: int = 0) -> None:
    """Keys are deterministic, totally ordered across nodes, and hooks can be called in the
    cache's order (insert, accesses, remove) without error."""
    rng = random.Random(seed)
    policy = instantiate("radix_eviction_policy", name)
    nodes = []
    for i in range(50):
        node = FakeNode(
            creation_time=float(i),
            last_access_time=float(i),
            hit_count=0,
            priority=rng.randint(0, 3),
        )
        policy.on_insert(node)
        nodes.append(node)
    for t in range(200):
        node = rng.choice(nodes)
        node.last_access_time = 50.0 + t
        node.hit_count += 1
        policy.on_access(node)
    keys = [policy.key(n) for n in nodes]
    assert keys == [policy.key(n) for n in nodes], f"{name}: key() must be deterministic"
    try:
        order = sorted(range(len(nodes)), key=lambda i: keys[i])
    except TypeError as e:
        raise AssertionError(f"{name}: keys must be mutually comparable: {e}") from e
    assert sorted(order) == list(range(len(nodes)))
    snapshot = copy.deepcopy(nodes)
    for n in nodes:
        policy.key(n)
    assert nodes == snapshot, f"{name}: key() must not mutate nodes"
    for n in nodes[:10]:
        policy.on_remove(n)
