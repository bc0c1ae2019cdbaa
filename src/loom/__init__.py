"""Loom: an LLM serving engine in which every subsystem is a plug-in behind one registry.

Public API: ``Engine`` and ``SamplingParams`` (imported lazily, so ``import loom`` stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from loom.engine.engine import Engine
    from loom.sampling.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from loom.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from loom.sampling.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
