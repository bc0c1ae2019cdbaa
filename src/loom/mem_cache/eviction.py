"""The radix_eviction_policy family: which evictable radix-cache leaf goes first.

A policy gives each evictable leaf a sort key; the radix cache evicts leaves in ascending key
order (the smallest key goes first). Policies never mutate nodes in ``key``; they may keep their
own bookkeeping in ``on_insert`` / ``on_access`` / ``on_remove``, which the cache calls exactly
once per event. ``key`` must be cheap and deterministic for a given node state: the cache may call
it any number of times (e.g. to rebuild its heap), and equal keys break ties by insertion order.
"""

from __future__ import annotations

from typing import Any

from loom.mem_cache.base import EvictableNode, RadixEvictionPolicy

__all__ = ["EvictableNode", "RadixEvictionPolicy"]


class LRUPolicy(RadixEvictionPolicy):
    """Least recently used goes first (SGLang's default)."""

    def key(self, node: EvictableNode) -> Any:
        return node.last_access_time


class LFUPolicy(RadixEvictionPolicy):
    """Fewest hits first; among equals, least recently used."""

    def key(self, node: EvictableNode) -> Any:
        return (node.hit_count, node.last_access_time)


class FIFOPolicy(RadixEvictionPolicy):
    """Oldest node first (creation time)."""

    def key(self, node: EvictableNode) -> Any:
        return node.creation_time


class MRUPolicy(RadixEvictionPolicy):
    """Most recently used first (good for one-pass scans)."""

    def key(self, node: EvictableNode) -> Any:
        return -node.last_access_time


class FILOPolicy(RadixEvictionPolicy):
    """Newest node first."""

    def key(self, node: EvictableNode) -> Any:
        return -node.creation_time


class PriorityPolicy(RadixEvictionPolicy):
    """Lowest request ``priority`` first (propagated up the tree as a max); then LRU."""

    def key(self, node: EvictableNode) -> Any:
        return (node.priority, node.last_access_time)


class SLRUPolicy(RadixEvictionPolicy):
    """Segmented LRU: nodes hit fewer than ``protected_threshold`` times (probationary) go
    before protected ones; LRU within a segment. ``--slru-protected-threshold`` sets it."""

    def __init__(self, protected_threshold: int = 2, **options: Any) -> None:
        super().__init__(protected_threshold=protected_threshold, **options)
        self.protected_threshold = protected_threshold

    def key(self, node: EvictableNode) -> Any:
        return (node.hit_count >= self.protected_threshold, node.last_access_time)
