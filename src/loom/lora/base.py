"""The interface of the ``lora_eviction_policy`` family (``LoRAEvictionPolicy``): which idle
adapter leaves the device pool first. (Why it is not the radix policies' contract:
``loom.mem_cache.base``.)
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class LoRAEvictionPolicy(ABC):
    """Chooses a victim among adapters that are loaded but not used by any running request.

    Contract: ``mark_used(name)`` is called each time a batch uses an adapter; ``select_victim``
    gets a non-empty list of candidates (never an adapter in use) and returns one of them;
    ``remove(name)`` is called when an adapter is unloaded, after which the policy forgets it.
    """

    @abstractmethod
    def mark_used(self, name: str) -> None: ...

    @abstractmethod
    def select_victim(self, candidates: list[str]) -> str: ...

    @abstractmethod
    def remove(self, name: str) -> None: ...
