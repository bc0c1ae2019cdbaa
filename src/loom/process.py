"""What Loom's child processes (the scheduler's, tensor-parallel ranks) do to end with their
parent."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
