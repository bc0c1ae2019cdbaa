"""Loom's C++ CPU kernels (``csrc/*.cpp`` beside the modules that use them), compiled the first
time they are needed by ``torch.utils.cpp_extension`` (cached under
``~/.cache/torch_extensions``) for CPUs with AVX-512 VNNI. Where that CPU feature or the
compiler is missing, ``build`` says why and callers keep PyTorch's kernels."""

from __future__ import annotations

import functools
import logging
import time

logger = logging.getLogger(__name__)

# the CPU features the kernels are compiled for
FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
FLAGS += ["-mf16c", "-mfma", "-fopenmp"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def build(name: str, source: str) -> str | None:
    """Compile and load the extension ``name`` from ``source`` (its ops register themselves
    with ``TORCH_LIBRARY``); the reason it cannot be used, or None."""
    missing = [f for f in FEATURES if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    from torch.utils import cpp_extension

    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[source],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja: PyTorch's kernels serve instead
        return f"{name} did not build: {type(e).__name__}: {str(e).strip()[-400:]}"
    logger.info("Loom's CPU kernels %s ready in %.1f s", name, time.perf_counter() - start)
    return None


@functools.cache
def warn_once(what: str, reason: str) -> None:
    logger.warning("%s: PyTorch's kernels serve (%s)", what, reason)
