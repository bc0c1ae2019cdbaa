"""Building the prefix cache the flags ask for: none, the radix tree, or the hierarchical one
(a host tier and, optionally, a storage backend) under a radix eviction policy."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable

from loom import plugins
from loom.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)


def build_prefix_cache(
    args,
    model_args,
    kv_pool,
    model_config,
    max_total_tokens: int,
    free_slots: Callable[[list[int]], None],
    alloc_slots: Callable[[int], list[int] | None],
) -> RadixCache | None:
    """The prefix cache for ``args`` (the cache section of the server arguments), or None with
    ``--disable-radix-cache``; ``model_args`` (the model section) name the weights a storage
    backend's entries belong to. ``free_slots`` / ``alloc_slots``: the tree's way to give KV slots
    back to the page allocator and (the host tier's loads) to take them."""
    if args.disable_radix_cache:
        return None
    policy_cls = plugins.resolve("radix_eviction_policy", args.radix_eviction_policy)
    # Every policy takes keyword options; those it does not use are ignored.
    policy = policy_cls(protected_threshold=args.slru_protected_threshold)
    if not args.enable_hierarchical_cache:
        return RadixCache(free_slots, policy, args.page_size)

    from loom.mem_cache.hiradix_cache import HiRadixCache, KVTransfer

    per_token = kv_pool.bytes_per_token(
        len(kv_pool.k_buffers), kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype
    )
    if args.hicache_size > 0:
        host_tokens = int(args.hicache_size * 1e9 // per_token)
    else:
        host_tokens = int(args.hicache_ratio * max_total_tokens)
    storage = None
    if args.hicache_storage_backend:
        extra = json.loads(args.hicache_storage_backend_extra_config or "{}")
        cls = plugins.resolve("hicache_storage", args.hicache_storage_backend)
        storage = cls(storage_namespace(args, model_args, kv_pool, model_config), **extra)
        if args.page_size < 8:
            logger.warning(
                "--hicache-storage-backend stores one entry per page: with --page-size %d "
                "that is %d tokens per entry; 16-64 is usual",
                args.page_size,
                args.page_size,
            )
    logger.info(
        "hierarchical cache: host tier %d tokens (%.1f MB), %s, storage %s",
        host_tokens,
        host_tokens * per_token / 2**20,
        args.hicache_write_policy,
        args.hicache_storage_backend or "none",
    )
    return HiRadixCache(
        free_slots,
        policy,
        args.page_size,
        alloc_slots=alloc_slots,
        transfer=KVTransfer(kv_pool),
        host_capacity_tokens=host_tokens,
        write_policy=args.hicache_write_policy,
        storage=storage,
    )


def storage_namespace(args, model_args, kv_pool, model_config) -> str:
    """The model's weights and the KV layout: stores are shared only between identical ones,
    wherever the model is installed (the path itself does not count)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(model_config.architecture))
    layout = (
        f"{model_fingerprint(str(model_config.path))}|{model_config.architecture}|"
        f"{kv_pool.dtype}|L{len(kv_pool.k_buffers)}|H{kv_pool.num_kv_heads}|"
        f"D{kv_pool.head_dim}|P{args.page_size}|{model_args.load_format}|"
        f"seed{model_args.random_seed}"
    )
    return f"{name[:48]}-{hashlib.sha256(layout.encode()).hexdigest()[:16]}"


def model_fingerprint(path: str) -> str:
    """What identifies a model's weights independently of where they are: the names and sizes
    of its weight files (a file model: its name and size), plus its config's text."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        h.update(f"{os.path.basename(path)}:{os.path.getsize(path)}".encode())
        if path.endswith(".json"):  # a config for --load-format dummy
            with open(path, "rb") as f:
                h.update(f.read())
        return h.hexdigest()
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if entry.endswith((".safetensors", ".bin", ".gguf", ".pt")):
            h.update(f"{entry}:{os.path.getsize(full)}".encode())
        elif entry == "config.json":
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()
