"""The interfaces of the mem_cache package's plug-in families: ``radix_eviction_policy``
(``RadixEvictionPolicy``, which orders the prefix tree's evictable leaves) and ``hicache_storage``
(``HiCacheStorage``, the hierarchical cache's third tier).

The radix and LoRA eviction policies keep separate contracts: a radix policy keys every
evictable leaf of a tree that may hold hundreds of thousands (the cache keeps them in a heap by
that key and calls it any number of times), while a LoRA policy picks one victim among the few
idle adapters holding device slots, once per load, from its own use history.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch


class EvictableNode(Protocol):
    """What a policy may read from a radix-tree node."""

    creation_time: float  # monotonic time the node was created
    last_access_time: float  # monotonic time of the last match or insert through it
    hit_count: int  # number of times a request matched through the node
    priority: int  # max `priority` of the requests that used the subtree (higher = keep longer)


class RadixEvictionPolicy(ABC):
    """Orders evictable leaves. Smallest key is evicted first."""

    def __init__(self, **options: Any) -> None:
        """``options`` come from server flags (e.g. ``protected_threshold`` for slru); a policy
        ignores the ones it does not use."""
        self.options = options

    @abstractmethod
    def key(self, node: EvictableNode) -> Any:
        """A sort key for ``node``; smaller keys are evicted first."""

    def on_insert(self, node: EvictableNode) -> None:  # noqa: B027 - optional hook
        """Called once when ``node`` is created."""

    def on_access(self, node: EvictableNode) -> None:  # noqa: B027 - optional hook
        """Called once each time a match or insert passes through ``node``."""

    def on_remove(self, node: EvictableNode) -> None:  # noqa: B027 - optional hook
        """Called once when ``node`` leaves the tree (evicted or merged away)."""


class HiCacheStorage(ABC):
    """A key-value store of KV pages.

    Contract (``loom.testing.check_hicache_storage``): ``write`` is atomic per page (a reader
    sees the whole page or nothing) and returns per page whether it is stored; ``read`` returns
    None for a page that is missing, corrupt or fails its checksum (never wrong data); ``exists``
    may be conservative (False when unsure). Backends should not raise on I/O failure: they
    return False / None and log; the cache wraps every call anyway, so a failing store means
    recomputation, never a failed request. Two namespaces never see each other's pages.
    ``attach``/``detach`` bracket the store's use by one engine. Calls may come from a
    background thread (one at a time).
    """

    def __init__(self, namespace: str, **extra_config: Any) -> None:
        self.namespace = namespace
        self.extra_config = extra_config

    def attach(self) -> None:  # noqa: B027 - optional hook
        """Open connections or directories."""

    def detach(self) -> None:  # noqa: B027 - optional hook
        """Release everything ``attach`` took."""

    @abstractmethod
    def read(self, keys: list[str]) -> list[torch.Tensor | None]: ...

    @abstractmethod
    def write(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]: ...

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...
