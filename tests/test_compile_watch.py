"""The Triton compile watch: counts and times compiles once armed, keeps hooks already set, and
leaves the compile to Triton (the cache hook answers False). The hooks are called as Triton's
JIT calls them (keyword arguments); a real compile on a GPU is in tests/gpu/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loom.model_executor.compile_watch import CompileWatch
from loom.scheduler.stats import SchedulerStats

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def hooks():
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_counts_compiles_once_armed_and_chains_earlier_hooks(hooks, caplog):
    seen = []
    hooks.jit_cache_hook = lambda **kw: seen.append("miss") or False
    hooks.jit_post_compile_hook = lambda **kw: seen.append("done")
    stats = SchedulerStats()
    watch = CompileWatch(stats)
    assert watch.install()
    kernel = SimpleNamespace(name="decode_attention")

    def compile_once():
        assert hooks.jit_cache_hook(key="k", repr="r", fn=kernel) is False  # Triton compiles
        hooks.jit_post_compile_hook(key="k", repr="r", fn=kernel)

    compile_once()  # start-up: warm-up's compiles are not counted
    assert stats.num_triton_compiles == 0
    watch.armed = True
    compile_once()
    assert stats.num_triton_compiles == 1 and stats.time_triton_compile_s > 0
    assert seen == ["miss", "done", "miss", "done"]
    assert "Triton compiled decode_attention while serving" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_compile_is_counted_and_a_cached_kernel_is_not(hooks):
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    stats = SchedulerStats()
    watch = CompileWatch(stats)
    watch.install()
    watch.armed = True
    x = torch.zeros(8, device="cuda")
    _add_one[(1,)](x, 8, BLOCK=16)
    _add_one[(1,)](x, 8, BLOCK=16)  # compiled once
    assert stats.num_triton_compiles == 1
    _add_one[(1,)](x, 8, BLOCK=32)  # a new constexpr: a new compile
    assert stats.num_triton_compiles == 2 and x[0].item() == 3
