"""The hierarchical KV cache: host tier, write policies, load-back, storage tiers (file, sqlite)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

import loom
from loom import plugins
from loom.mem_cache.eviction import LRUPolicy
from loom.mem_cache.hiradix_cache import HiRadixCache, KVTransfer
from loom.mem_cache.memory_pool import KVPool, PageAllocator
from loom.mem_cache.storage import page_hashes
from loom.testing import check_hicache_storage
from tests.conftest import save_tiny_llama

PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


# ---- the tree with a real pool -------------------------------------------------------------


class Harness:
    def __init__(self, page_size=2, num_pages=16, host_tokens=64, write_policy="write_through"):
        self.ps = page_size
        self.pool = KVPool(num_pages, page_size, 2, 1, 4, torch.float32, torch.device("cpu"))
        self.alloc = PageAllocator(num_pages, page_size)
        self.tree = HiRadixCache(
            self.free,
            LRUPolicy(),
            page_size,
            alloc_slots=self.alloc_slots,
            transfer=KVTransfer(self.pool),
            host_capacity_tokens=host_tokens,
            write_policy=write_policy,
        )

    def free(self, slots):
        self.alloc.free(sorted({s // self.ps for s in slots}))

    def alloc_slots(self, n):
        need = n // self.ps
        if need > self.alloc.num_free:
            self.tree.evict((need - self.alloc.num_free) * self.ps)
        pages = self.alloc.alloc(need)
        return None if pages is None else [p * self.ps + i for p in pages for i in range(self.ps)]

    def compute(self, tokens):
        """'Prefill' tokens: fresh slots whose KV is a function of (position, token)."""
        slots = self.alloc_slots(len(tokens))
        for pos, (s, t) in enumerate(zip(slots, tokens, strict=True)):
            for layer in range(2):
                self.pool.k_buffers[layer][s] = t + 1000 * pos + 0.5 * layer
                self.pool.v_buffers[layer][s] = -(t + 1000 * pos) - 0.5 * layer
        back = self.tree.cache(tokens, slots)
        self.free(back)

    def kv_ok(self, tokens, slots):
        for pos, (s, t) in enumerate(zip(slots, tokens, strict=True)):
            for layer in range(2):
                if not torch.all(self.pool.k_buffers[layer][s] == t + 1000 * pos + 0.5 * layer):
                    return False
                if not torch.all(self.pool.v_buffers[layer][s] == -(t + 1000 * pos) - 0.5 * layer):
                    return False
        return True

    def balance(self):
        self.tree.check()
        assert self.alloc.num_free * self.ps + self.tree.total_size == 16 * self.ps


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_evicted_prefixes_load_back_from_host_with_their_kv(policy):
    h = Harness(write_policy=policy)
    seqs = [[i] * 2 + [100 + i] * 6 for i in range(6)]  # 6 x 8 tokens > 16 pages x 2 = 32 slots
    for s in seqs:
        h.compute(s)
        h.balance()
    if policy == "write_through_selective":
        assert h.tree.hstats.backup_tokens < 48  # only hot nodes, or on forced eviction
    assert h.tree.num_evicted_tokens > 0
    slots, node = h.tree.match_and_load(seqs[0])
    h.balance()
    if policy == "write_through_selective":
        return  # cold prefixes were not written to host: nothing guaranteed to come back
    assert len(slots) == 8 and h.kv_ok(seqs[0], slots)
    assert h.tree.hstats.host_hit_tokens >= 8


def test_host_tier_evicts_when_full():
    h = Harness(host_tokens=16)
    for i in range(10):
        h.compute([i, i, 50 + i, 50 + i, 7, 7])
        h.balance()
    assert h.tree.host_size <= 16


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    for policy in ("write_through", "write_through_selective", "write_back"):
        h = Harness(write_policy=policy, host_tokens=24)
        for _ in range(150):
            toks = [rng.randrange(4) for _ in range(rng.choice([2, 4, 6, 8]))]
            if rng.random() < 0.5:
                h.compute(toks)
            else:
                slots, node = h.tree.match_and_load(toks)
                assert h.kv_ok(toks[: len(slots)], slots)
            h.balance()


# ---- hash chain and storage kit ------------------------------------------------------------


def test_page_hashes_are_sha256_chains():
    toks = [5, 6, 7, 8, 9]
    d0 = hashlib.sha256(b"").digest()
    d1 = hashlib.sha256(d0 + struct.pack("<2q", 5, 6)).digest()
    d2 = hashlib.sha256(d1 + struct.pack("<2q", 7, 8)).digest()
    assert page_hashes(toks, 2) == [d1.hex(), d2.hex()]
    assert page_hashes(toks[2:], 2, prev=d1.hex()) == [d2.hex()]
    assert page_hashes(toks, 2, extra_key="salt") != page_hashes(toks, 2)


@pytest.mark.parametrize("name", plugins.names("hicache_storage"))
def test_storage_kit(name, tmp_path):
    check_hicache_storage(name, {"path": str(tmp_path / f"store-{name}")})


# ---- end to end ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-hicache"), initializer_range=0.2)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(3, 500) for _ in range(40)] for _ in range(8)]


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    with loom.Engine(model=tiny, skip_tokenizer_init=True, disable_radix_cache=True) as e:
        return [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=PARAMS)]


def _one_by_one(e, prompts):
    return [e.generate(input_ids=p, sampling_params=PARAMS) for p in prompts]


# The device pool holds ~a quarter of the working set (8 x 48 tokens).
SMALL = dict(max_total_tokens=96, page_size=4, max_running_requests=2, skip_tokenizer_init=True)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_host_tier_hits_when_the_device_pool_is_a_quarter(tiny, prompts, reference, policy):
    kw = dict(SMALL, enable_hierarchical_cache=True, hicache_write_policy=policy, hicache_ratio=5)
    with loom.Engine(model=tiny, **kw) as e:
        # Round 0 asks each prompt three times in a row (hot: write_through_selective backs it
        # up on its second hit); later rounds cycle through all eight, which the device pool
        # cannot hold, so every hit comes back from host memory.
        warm = [_one_by_one(e, [p] * 3) for p in prompts]
        rounds = [_one_by_one(e, prompts) for _ in range(2)]
        tree = e.scheduler.cache.tree
        e.scheduler.check_kv_balance()
        tree.check()
    assert [w[0]["output_ids"] for w in warm] == reference
    for outs in rounds:
        assert [o["output_ids"] for o in outs] == reference
        assert all(o["meta_info"]["cached_tokens"] == 36 for o in outs)
    assert tree.hstats.host_hit_tokens >= 2 * 8 * 36
    with loom.Engine(model=tiny, **SMALL) as e:  # without the host tier: evicted, no hits
        _one_by_one(e, prompts)
        assert sum(o["meta_info"]["cached_tokens"] for o in _one_by_one(e, prompts)) == 0


def _storage_kw(backend, path):
    extra = {"path": str(path)}
    return dict(
        SMALL,
        enable_hierarchical_cache=True,
        hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=json.dumps(extra),
    )


@pytest.mark.parametrize("backend", ["file", "sqlite"])
def test_a_new_process_hits_in_storage(tiny, prompts, reference, tmp_path, backend):
    path = tmp_path / ("kv" if backend == "file" else "kv.sqlite")
    kw = _storage_kw(backend, path)
    with loom.Engine(model=tiny, **kw) as e:
        first = _one_by_one(e, prompts[:2])
    with loom.Engine(model=tiny, backend="process", **kw) as e:  # a new scheduler process
        again = _one_by_one(e, prompts[:2])
    assert [o["output_ids"] for o in first + again] == reference[:2] * 2
    assert [o["meta_info"]["cached_tokens"] for o in again] == [36, 36]


def test_corrupt_page_file_is_detected_and_recomputed(tiny, prompts, reference, tmp_path, caplog):
    kw = _storage_kw("file", tmp_path / "kv")
    with loom.Engine(model=tiny, **kw) as e:
        _one_by_one(e, prompts[:1])
    files = sorted(Path(tmp_path / "kv").glob("*/*/*.kv"))
    assert len(files) >= 9  # 36 cached prompt tokens + outputs, in pages of 4
    # corrupt the page holding prompt tokens 16..19
    key = page_hashes(prompts[0][:20], 4)[-1]
    bad = next(f for f in files if f.stem == key)
    blob = bytearray(bad.read_bytes())
    blob[-3] ^= 0xFF
    bad.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING), loom.Engine(model=tiny, **kw) as e:
        out = _one_by_one(e, prompts[:1])[0]
    assert out["output_ids"] == reference[0]
    assert out["meta_info"]["cached_tokens"] == 16  # the pages before the corrupt one
    assert "corrupt" in caplog.text


@pytest.mark.parametrize("failure", ["vanishes", "read-only"])
def test_storage_failure_mid_run_only_costs_hits(
    tiny, prompts, reference, tmp_path, caplog, failure
):
    root = tmp_path / "kv"
    kw = _storage_kw("file", root)
    with caplog.at_level(logging.WARNING), loom.Engine(model=tiny, **kw) as e:
        outs = _one_by_one(e, prompts[:2])
        e.scheduler.cache.tree.writer.drain()
        shutil.rmtree(root)
        if failure == "read-only":  # root ignores permissions: make the path unusable instead
            root.write_text("not a directory")
        outs += _one_by_one(e, prompts[2:5])
        e.scheduler.cache.tree.writer.drain()
        e.scheduler.flush_cache()  # force the next requests to look in storage
        outs += _one_by_one(e, prompts[:2])
    assert [o["output_ids"] for o in outs] == reference[:5] + reference[:2]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    if failure == "read-only":
        assert "failed" in caplog.text


def test_store_is_shared_by_copies_of_a_model_and_not_by_other_models(tiny, prompts, tmp_path):
    """The namespace is the weights and KV layout, not the install path: a copy of the model
    elsewhere hits; a model with other weights does not."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny, copy)
    other = save_tiny_llama(tmp_path / "other", seed=1, initializer_range=0.2, vocab_size=520)
    kw = _storage_kw("file", tmp_path / "kv")
    with loom.Engine(model=tiny, **kw) as e:
        _one_by_one(e, prompts[:1])
    with loom.Engine(model=str(copy), **kw) as e:
        assert _one_by_one(e, prompts[:1])[0]["meta_info"]["cached_tokens"] == 36
    with loom.Engine(model=other, **kw) as e:
        assert _one_by_one(e, prompts[:1])[0]["meta_info"]["cached_tokens"] == 0


def test_fp8_kv_cache_through_host_memory_and_storage(tiny, prompts, tmp_path):
    """--kv-cache-dtype fp8_e5m2: prefix hits from the device, host memory and storage give the
    same greedy tokens as computing everything (fp8 pages travel as bytes)."""
    fp8 = dict(kv_cache_dtype="fp8_e5m2")
    with loom.Engine(model=tiny, skip_tokenizer_init=True, disable_radix_cache=True, **fp8) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=PARAMS)]
        assert e.runner.kv_pool.dtype == torch.float8_e5m2
    kw = dict(_storage_kw("file", tmp_path / "kv"), hicache_ratio=5, **fp8)
    with loom.Engine(model=tiny, **kw) as e:
        rounds = [_one_by_one(e, prompts) for _ in range(2)]
        e.scheduler.check_kv_balance()
        assert e.scheduler.cache.tree.hstats.host_hit_tokens > 0
    with loom.Engine(model=tiny, backend="process", **kw) as e:  # hits in storage
        again = _one_by_one(e, prompts[:2])
    for outs in rounds:
        assert [o["output_ids"] for o in outs] == want
    assert [o["output_ids"] for o in again] == want[:2]
    assert [o["meta_info"]["cached_tokens"] for o in again] == [36, 36]
