"""``example_lfu_then_lru``: evict the least-hit leaf first; among equals, the least recent."""

from __future__ import annotations

from typing import Any

from loom.mem_cache.eviction import EvictableNode, RadixEvictionPolicy


class LFUThenLRUPolicy(RadixEvictionPolicy):
    """Least frequently used goes first; ties on ``hit_count`` go least recently used first.

    The key reads only the node (no bookkeeping of its own), so it is deterministic for a given
    node state, as the family's contract requires.
    """

    def key(self, node: EvictableNode) -> Any:
        return (node.hit_count, node.last_access_time)
