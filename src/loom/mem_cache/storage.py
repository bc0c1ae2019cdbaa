"""The hicache_storage family: the third tier of the hierarchical KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class HiCacheStorage(ABC):
    """A key-value store of KV pages.

    Keys are hex digests of a hash chain over token ids (SHA-256 over the previous page's digest and
    this page's ids), so equal prefixes map to equal keys across processes and restarts. Contract:
    ``write`` is atomic per page (a reader sees the whole page or nothing); ``read`` returns None for
    a page that is missing or fails its checksum (never corrupt data); ``exists`` may be
    conservative (False when unsure). ``attach``/``detach`` bracket the store's use by one engine.
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
