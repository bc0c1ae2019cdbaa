"""The hierarchical KV cache (``--enable-hierarchical-cache``): a radix tree whose nodes live on
the device, in host memory, or both, with an optional third tier (a ``hicache_storage`` plug-in).

A node's ``value`` holds its device slots (None once evicted from the device) and ``host_kv``
its host copy, a tensor ``[layers, 2, tokens, kv_heads, head_dim]`` (None when not backed up).
Device-resident nodes form a subtree at the top of the tree: a node is on the device only if
its parent is.

- **Write policies** decide when device KV is copied to the host: ``write_through`` as soon as it
  is inserted, ``write_through_selective`` once a node has been hit ``WRITE_THROUGH_THRESHOLD``
  times, ``write_back`` only when it is evicted from the device.
- **Device eviction** (the allocator ran dry) frees the device slots of unlocked device leaves in
  the eviction policy's order; a node with a host copy stays in the tree, host-only. The host tier
  evicts in the same order when it is full (host-only leaves are removed from the tree).
- **Load-back**: admission matches on the device, continues through host-only nodes and copies
  them back into freshly allocated device pages, then asks the storage tier for the following
  pages (keys: :func:`~loom.mem_cache.storage.page_hashes`). On CUDA the copies run on a side
  stream and the forward pass waits on an event, so they overlap whatever the GPU is running.
- **Storage writes** happen in a background thread after each host backup; a store that fails
  (raises, vanishes, turns read-only) is logged and skipped: the request recomputes.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Hashable

import torch

from loom.mem_cache.base import HiCacheStorage, RadixEvictionPolicy
from loom.mem_cache.hicache_io import HiCacheStats, KVTransfer, StorageWriter
from loom.mem_cache.radix_cache import RadixCache, TreeNode
from loom.mem_cache.storage import page_hashes

__all__ = ["HiCacheStats", "HiRadixCache", "KVTransfer"]

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
WRITE_THROUGH_THRESHOLD = 2


class HiRadixCache(RadixCache):
    def __init__(
        self,
        free_slots: Callable[[list[int]], None],
        policy: RadixEvictionPolicy,
        page_size: int,
        *,
        alloc_slots: Callable[[int], list[int] | None],
        transfer: KVTransfer,
        host_capacity_tokens: int,
        write_policy: str = "write_through",
        storage: HiCacheStorage | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown hicache write policy {write_policy!r}")
        self.alloc_slots = alloc_slots
        self.transfer = transfer
        self.host_capacity = host_capacity_tokens - host_capacity_tokens % page_size
        self.write_policy = write_policy
        self.storage = storage
        self.hstats = HiCacheStats()
        self.host_size = 0
        self._loading: TreeNode | None = None
        super().__init__(free_slots, policy, page_size)
        self.writer = None
        if storage is not None:
            storage.attach()
            self.writer = StorageWriter(storage, page_size, self.hstats)

    def reset(self) -> None:
        super().reset()
        self.host_size = 0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.drain()
            self.writer.close()
            self.writer = None
            try:
                self.storage.detach()
            except Exception as e:  # noqa: BLE001
                logger.warning("hicache storage detach failed: %s", e)

    # ---- helpers --------------------------------------------------------------------------

    @staticmethod
    def _on_device(node: TreeNode) -> bool:
        return node.value is not None

    def _path_tokens(self, node: TreeNode) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def _storage_call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a failing store is a miss
            self.hstats.storage_failures += 1
            logger.warning("hicache storage %s failed: %s", getattr(fn, "__name__", fn), e)
            return None

    # ---- host tier ------------------------------------------------------------------------

    def _ensure_host_room(self, n: int) -> bool:
        if n > self.host_capacity:
            return False
        if self.host_size + n <= self.host_capacity:
            return True
        heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.host_kv is not None and self._host_evictable(node):
                heap.append((self.policy.key(node), node.id, node))
        heapq.heapify(heap)
        while self.host_size + n > self.host_capacity and heap:
            _, _, node = heapq.heappop(heap)
            if node.host_kv is None or not self._host_evictable(node):
                continue
            parent = node.parent
            self._drop_host(node)
            if not self._on_device(node):
                self._remove(node)
                if (
                    parent is not self.root
                    and parent.host_kv is not None
                    and self._host_evictable(parent)
                ):
                    heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return self.host_size + n <= self.host_capacity

    def _host_evictable(self, node: TreeNode) -> bool:
        # A device-resident node can drop its copy; a host-only node only when it is a leaf.
        if node is self._loading:
            return False
        return self._on_device(node) or not node.children

    def _drop_host(self, node: TreeNode) -> None:
        if node.pending is not None:
            node.pending.synchronize()
            node.pending = None
        self.host_size -= len(node.key)
        node.host_kv = None

    def _remove(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, node.extra_key, parent)]
        self.policy.on_remove(node)

    def _backup(self, node: TreeNode) -> bool:
        """Copy a device node to host memory (and queue it for the storage tier)."""
        if node.host_kv is not None:
            return True
        if not self._ensure_host_room(len(node.key)):
            return False
        node.host_kv, node.pending = self.transfer.to_host(node.value)
        self.host_size += len(node.key)
        self.hstats.backup_tokens += len(node.key)
        if self.writer is not None:
            path = self._path_tokens(node)
            keys = page_hashes(path, self.page_size, node.extra_key)[
                -(len(node.key) // self.page_size) :
            ]
            self.writer.submit(keys, node.host_kv, node.pending)
        return True

    # ---- lookups --------------------------------------------------------------------------

    # ``match_prefix`` (inherited) matches the device-resident part; ``match_and_load`` the rest.
    def _matchable(self, node: TreeNode) -> bool:
        return self._on_device(node)

    def _on_matched(self, node: TreeNode) -> None:
        if (
            self.write_policy == "write_through_selective"
            and node.hit_count >= WRITE_THROUGH_THRESHOLD
        ):
            self._backup(node)

    def match_and_load(self, key: list[int], extra_key: Hashable = None):
        """Match on the device, then load the continuation back from host memory and from the
        storage tier into new device pages. Returns (device slots of the whole match, its last
        node), like ``match_prefix``."""
        slots, node = self.match_prefix(key, extra_key)
        key_t = tuple(key[len(slots) : self._aligned(len(key))])
        self.inc_lock_ref(node)  # nothing on the path may be evicted while loading
        locked = [node]
        try:
            now = self._tick()
            while key_t:
                child = node.children.get(self._child_key(key_t, extra_key, node))
                if child is None or self._on_device(child) or child.host_kv is None:
                    break
                n = self._common(child.key, key_t)
                if n == 0:
                    break
                if n < len(child.key):
                    child = self._split(child, n, now)
                self._loading = child  # its host copy must survive the allocation's evictions
                try:
                    dev = self.alloc_slots(n)
                finally:
                    self._loading = None
                if dev is None:
                    break
                self.transfer.to_device(child.host_kv, dev, child.pending)
                child.value = dev
                self.evictable_size += n
                self._touch(child, now, hit=True)
                self.inc_lock_ref(child)  # counts its tokens as protected
                locked.append(child)
                self.hstats.host_hit_tokens += n
                slots += dev
                node, key_t = child, key_t[n:]
            if key_t and self.storage is not None and not self._has_child(node, key_t, extra_key):
                got = self._load_from_storage(node, list(key_t), extra_key, now)
                if got is not None:
                    self.inc_lock_ref(got)
                    locked.append(got)
                    slots += got.value
                    node = got
        finally:
            for n_ in locked:
                self.dec_lock_ref(n_)
        return slots, node

    def _has_child(self, node, key_t, extra_key) -> bool:
        return self._child_key(key_t, extra_key, node) in node.children

    def _load_from_storage(self, node, rest: list[int], extra_key, now) -> TreeNode | None:
        ps = self.page_size
        prefix = self._path_tokens(node)
        keys = page_hashes(prefix + rest, ps, extra_key)[len(prefix) // ps :]
        if not keys:
            return None
        have = self._storage_call(self.storage.exists, keys) or []
        run = 0
        while run < len(have) and have[run]:
            run += 1
        if run == 0:
            return None
        pages = self._storage_call(self.storage.read, keys[:run]) or []
        pool = self.transfer.pool
        shape = (len(pool.k_buffers), 2, ps, pool.num_kv_heads, pool.head_dim)
        good = []
        for p in pages:
            if p is None or tuple(p.shape) != shape or p.dtype != pool.copy_dtype:
                break
            good.append(p)
        if not good:
            return None
        host = torch.cat(good, dim=2)
        n = host.shape[2]
        dev = self.alloc_slots(n)
        if dev is None:
            return None
        self.transfer.to_device(host, dev)
        new = TreeNode(node, tuple(rest[:n]), dev, extra_key, now)
        node.children[self._child_key(new.key, extra_key, node)] = new
        self.evictable_size += n
        self.policy.on_insert(new)
        if self._ensure_host_room(n):
            new.host_kv = host if not self.transfer.cuda else host.pin_memory()
            self.host_size += n
        self.hstats.storage_hit_tokens += n
        return new

    # ---- inserts --------------------------------------------------------------------------

    def cache(self, key, value, extra_key=None, priority=0):
        """Like the base ``cache``; a host-only node on the path is revived with the caller's
        slots (they become its device copy) instead of being treated as a duplicate."""
        now = self._tick()
        n_aligned = self._aligned(len(key))
        key_t, rest = tuple(key[:n_aligned]), list(value[:n_aligned])
        give_back: list[int] = list(value[n_aligned:])
        node = self.root
        path = []
        while key_t:
            ck = self._child_key(key_t, extra_key, node)
            child = node.children.get(ck)
            if child is None:
                node = self._add_leaf(node, ck, key_t, rest, extra_key, priority, now)
                path.append(node)
                break
            n = self._common(child.key, key_t)
            if n < len(child.key):
                child = self._split(child, n, now)
            if self._on_device(child):
                give_back += rest[:n]
            elif self._on_device(node):
                child.value = rest[:n]  # revive: the caller's slots become the device copy
                self.evictable_size += n
            else:  # cannot revive under a host-only parent; keep the caller's copy out
                give_back += rest
                break
            self._touch(child, now, hit=False)
            child.priority = max(child.priority, priority)
            path.append(child)
            node, key_t, rest = child, key_t[n:], rest[n:]
        while node.parent is not None and node.parent is not self.root:
            node.parent.priority = max(node.parent.priority, node.priority)
            node = node.parent
        if self.write_policy == "write_through":
            for p in path:
                if self._on_device(p):
                    self._backup(p)
        return give_back

    def insert(self, key, value, extra_key=None, priority=0):
        give_back = self.cache(key, value, extra_key, priority)
        return len(give_back) - (len(key) - self._aligned(len(key)))

    # ---- device eviction ------------------------------------------------------------------

    def _device_leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if self._on_device(c)]
            stack.extend(kids)
            if node is not self.root and not kids and node.lock_ref == 0:
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> int:
        heap = [(self.policy.key(n), n.id, n) for n in self._device_leaves()]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.host_kv is None and (self.write_policy == "write_back" or node.children):
                self._backup(node)
            if node.host_kv is None:
                self._drop_subtree(node)
                self._remove(node)
            if node.pending is not None:  # its device slots are about to be reused
                node.pending.synchronize()
                node.pending = None
            self.free_slots(list(node.value))
            freed += len(node.value)
            self.num_evicted_tokens += len(node.value)
            self.evictable_size -= len(node.key)
            node.value = None
            parent = node.parent
            if (
                parent is not self.root
                and parent.lock_ref == 0
                and not any(self._on_device(c) for c in parent.children.values())
            ):
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return freed

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove ``node``'s (host-only) descendants."""
        for child in list(node.children.values()):
            self._drop_subtree(child)
            if child.host_kv is not None:
                self._drop_host(child)
            self._remove(child)

    def flush(self) -> None:
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.value:
                if node.pending is not None:
                    node.pending.synchronize()
                self.free_slots(list(node.value))
        self.reset()

    # ---- checks ---------------------------------------------------------------------------

    def all_slots(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out += node.value or []
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        evictable = protected = host = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node, "broken parent link"
                assert ck == self._child_key(child.key, child.extra_key, node), "bad child key"
                assert child.key and len(child.key) % self.page_size == 0, "bad edge"
                if self._on_device(child):
                    assert len(child.value) == len(child.key), "bad device value"
                    assert node is self.root or self._on_device(node), "device under host-only"
                    if child.lock_ref > 0:
                        protected += len(child.key)
                    else:
                        evictable += len(child.key)
                else:
                    assert child.host_kv is not None, "a node with neither device nor host KV"
                    assert child.lock_ref == 0, "a locked host-only node"
                if child.host_kv is not None:
                    assert child.host_kv.shape[2] == len(child.key), "bad host copy"
                    host += len(child.key)
                stack.append(child)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            "sizes do not add up"
        )
        assert host == self.host_size <= self.host_capacity, "host size does not add up"
        slots = self.all_slots()
        assert len(slots) == len(set(slots)), "a slot is in the tree twice"
