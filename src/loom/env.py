"""Everything Loom reads from the environment, in one place: the plug-in allow-list and cache
locations (configuration lives in ``ServerArgs``), plus Triton's own interpreter switch, which
decides whether Loom's kernels can run on a CPU.

- ``LOOM_PLUGINS``: comma-separated entry-point names to load (unset: all; empty: none).
- ``LOOM_CACHE_DIR``: the root of Loom's caches (GGUF conversions, the hierarchical cache's
  file storage); default ``~/.cache/loom`` (the storage honours ``XDG_CACHE_HOME``).
- ``LOOM_GGUF_CACHE=0``: do not cache GGUF conversions.
- ``TRITON_INTERPRET=1`` (Triton's): run Triton kernels on CPU tensors (tests).
"""

from __future__ import annotations

import os
from pathlib import Path


def plugin_allow_list() -> set[str] | None:
    allow = os.environ.get("LOOM_PLUGINS")
    if allow is None:
        return None
    return {s.strip() for s in allow.split(",") if s.strip()}


def cache_root() -> str:
    return os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "loom"
    )


def storage_root() -> Path:
    base = os.environ.get("LOOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loom"
    )
    return Path(base)


def gguf_cache_enabled() -> bool:
    return os.environ.get("LOOM_GGUF_CACHE", "1") != "0"


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
