"""The lora_eviction_policy family: which LoRA adapter leaves the device pool first."""

from __future__ import annotations

from loom.lora.base import LoRAEvictionPolicy

__all__ = ["LoRAEvictionPolicy"]


class LRUPolicy(LoRAEvictionPolicy):
    """The adapter used longest ago leaves first."""

    def __init__(self) -> None:
        self._clock = 0
        self._last: dict[str, int] = {}

    def mark_used(self, name: str) -> None:
        self._clock += 1
        self._last[name] = self._clock

    def select_victim(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda n: self._last.get(n, 0))

    def remove(self, name: str) -> None:
        self._last.pop(name, None)


class LFUPolicy(LoRAEvictionPolicy):
    """The adapter used least often since it was loaded leaves first (ties: used longest ago)."""

    def __init__(self) -> None:
        self._clock = 0
        self._uses: dict[str, int] = {}
        self._last: dict[str, int] = {}

    def mark_used(self, name: str) -> None:
        self._clock += 1
        self._uses[name] = self._uses.get(name, 0) + 1
        self._last[name] = self._clock

    def select_victim(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda n: (self._uses.get(n, 0), self._last.get(n, 0)))

    def remove(self, name: str) -> None:
        self._uses.pop(name, None)
        self._last.pop(name, None)


class FIFOPolicy(LoRAEvictionPolicy):
    """The adapter loaded first leaves first, however recently it was used."""

    def __init__(self) -> None:
        self._clock = 0
        self._loaded: dict[str, int] = {}

    def mark_used(self, name: str) -> None:
        if name not in self._loaded:
            self._clock += 1
            self._loaded[name] = self._clock

    def select_victim(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda n: self._loaded.get(n, 0))

    def remove(self, name: str) -> None:
        self._loaded.pop(name, None)
