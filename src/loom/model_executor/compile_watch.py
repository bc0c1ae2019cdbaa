"""Triton compiles after start-up, counted and timed.

A Triton kernel compiles the first time it meets a new specialisation (dtypes, constexprs,
16-byte alignment of its pointers, which integers are 1): warm-up runs each batch shape once so
serving finds them compiled. One that still compiles while serving stalls the step that launched
it for the compile's length (tens to hundreds of ms). The watch hooks Triton's JIT (the cache
hook fires on an in-memory miss, before compiling or loading from the disk cache; the
post-compile hook after), and once armed counts each compile in the scheduler's stats and logs
the kernel and its time.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self, stats) -> None:
        self.stats = stats
        self.armed = False
        self._started: float | None = None

    def install(self) -> bool:
        """Hook Triton's JIT (keeping hooks already set); False without Triton."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        prev_miss, prev_done = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def on_miss(**kw) -> bool:
            self._started = time.perf_counter()
            return bool(prev_miss(**kw)) if prev_miss else False  # True would skip the compile

        def on_done(**kw) -> None:
            if prev_done:
                prev_done(**kw)
            if not self.armed or self._started is None:
                return
            seconds = time.perf_counter() - self._started
            self._started = None
            self.stats.num_triton_compiles += 1
            self.stats.time_triton_compile_s += seconds
            name = getattr(kw.get("fn"), "name", "?")
            logger.warning(
                "Triton compiled %s while serving (%.0f ms): a batch shape warm-up did not run",
                name,
                1000 * seconds,
            )

        runtime.jit_cache_hook = on_miss
        runtime.jit_post_compile_hook = on_done
        return True
