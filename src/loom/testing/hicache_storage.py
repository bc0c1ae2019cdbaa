"""Conformance kit of the hicache_storage family."""

from __future__ import annotations

from typing import Any

import torch

from loom import plugins


def check_hicache_storage(
    name: str, extra_config: dict[str, Any] | None = None, seed: int = 0
) -> None:
    """Pages round-trip bit-exactly in every KV dtype; a missing key reads None and does not
    exist; rewriting a page is harmless; two namespaces never see each other's pages; a second
    instance on the same configuration (another process, a restart) reads what the first wrote;
    attach/detach may be repeated."""
    from loom.mem_cache.storage import page_hashes

    extra = dict(extra_config or {})
    cls = plugins.resolve("hicache_storage", name)
    gen = torch.Generator().manual_seed(seed)
    a, b = cls("kit-model-a", **extra), cls("kit-model-b", **extra)
    a.attach()
    b.attach()
    try:
        keys = page_hashes(list(range(32)), 8, extra_key=f"kit-{seed}")
        pages = [
            (torch.randn(2, 2, 8, 2, 4, generator=gen) * 3).to(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.bfloat16)
        ]
        assert a.exists(keys) == [False] * 4, f"{name}: unknown keys must not exist"
        assert a.read(keys[:1]) == [None], f"{name}: a missing page must read as None"
        assert a.write(keys, pages) == [True] * 4, f"{name}: write must report success"
        assert a.exists(keys) == [True] * 4, f"{name}: written pages must exist"
        got = a.read(keys)
        for want, have in zip(pages, got, strict=True):
            assert have is not None and have.dtype == want.dtype and torch.equal(have, want), (
                f"{name}: pages must round-trip exactly"
            )
        assert a.write(keys[:1], pages[:1]) == [True], f"{name}: rewriting must succeed"
        assert torch.equal(a.read(keys[:1])[0], pages[0])
        assert b.exists(keys) == [False] * 4, f"{name}: namespaces must be isolated"
        assert b.read(keys[:1]) == [None]
        again = cls("kit-model-a", **extra)
        again.attach()
        try:
            assert torch.equal(again.read(keys[2:3])[0], pages[2]), (
                f"{name}: another instance must read what the first wrote"
            )
        finally:
            again.detach()
    finally:
        a.detach()
        b.detach()
    a.attach()
    a.detach()
