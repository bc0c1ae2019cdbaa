"""A radix tree over KV slots: the prefix cache (RadixAttention).

Each edge holds a run of token ids (``key``) and the KV slots that hold their K/V (``value``).
Keys are namespaced by an ``extra_key`` (LoRA adapter, ``cache_salt``): different namespaces
never share a node. With ``page_size`` > 1 only whole pages are cached, and edges split on page
boundaries only.

Invariants (checked by ``check``):
- every node but the root has a non-empty key, ``len(key) == len(value)``, and its key's first
  page is its parent's child key;
- ``lock_ref`` of a node counts the requests whose matched path runs through it; a node with
  ``lock_ref > 0`` is never evicted; the root is always locked;
- ``total_size == evictable_size + protected_size`` where protected tokens are those on locked
  nodes;
- every slot is in the tree at most once; slots leave only through ``evict`` (given back through
  ``free_slots``) or ``reset``.

The scheduler matches and locks a prefix on admission, inserts after every chunk of a chunked
prefill and when a request finishes or is retracted, and evicts when the allocator runs dry;
cache-aware schedule policies read it through ``peek_prefix``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from typing import Any

from loom.mem_cache.base import RadixEvictionPolicy


class TreeNode:
    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "creation_time",
        "last_access_time",
        "hit_count",
        "priority",
        "extra_key",
        "id",
        "host_kv",  # hierarchical cache: the node's KV in host memory, or None
        "pending",  # hierarchical cache: event of a device-to-host copy still in flight
    )

    _ids = itertools.count()

    def __init__(
        self,
        parent: TreeNode | None = None,
        key: tuple[int, ...] = (),
        value: list[int] | None = None,
        extra_key: Hashable = None,
        now: float = 0.0,
    ) -> None:
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value or []
        self.lock_ref = 0
        self.creation_time = now
        self.last_access_time = now
        self.hit_count = 0
        self.priority = 0
        self.extra_key = extra_key
        self.id = next(TreeNode._ids)
        self.host_kv = None
        self.pending = None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, lock={self.lock_ref}, hits={self.hit_count})"


class RadixCache:
    def __init__(
        self,
        free_slots: Callable[[list[int]], None],
        policy: RadixEvictionPolicy,
        page_size: int = 1,
    ) -> None:
        self.free_slots = free_slots
        self.policy = policy
        self.page_size = page_size
        self._clock = 0.0  # logical time: one tick per operation, deterministic
        self.num_evicted_tokens = 0
        self.reset()

    # ---- bookkeeping ----------------------------------------------------------------------

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> float:
        self._clock += 1.0
        return self._clock

    def _child_key(self, key: tuple[int, ...], extra_key: Hashable, node: TreeNode) -> Hashable:
        first = key[: self.page_size]
        return (extra_key, first) if node is self.root else first

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _common(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return self._aligned(n)

    def _touch(self, node: TreeNode, now: float, hit: bool) -> None:
        node.last_access_time = now
        if hit:
            node.hit_count += 1
        self.policy.on_access(node)

    # ---- lookups and inserts --------------------------------------------------------------

    def match_prefix(
        self, key: list[int], extra_key: Hashable = None
    ) -> tuple[list[int], TreeNode]:
        """The slots of the longest cached page-aligned prefix of ``key`` and the last node of
        the match (split so that it ends exactly there). Counts a hit on every node used."""
        now = self._tick()
        key_t = tuple(key[: self._aligned(len(key))])
        node, slots = self.root, []
        while key_t:
            child = node.children.get(self._child_key(key_t, extra_key, node))
            if child is None or not self._matchable(child):
                break
            n = self._common(child.key, key_t)
            if n < len(child.key):
                if n == 0:
                    break
                child = self._split(child, n, now)
            self._touch(child, now, hit=True)
            self._on_matched(child)
            slots += child.value
            node, key_t = child, key_t[n:]
        return slots, node

    def _matchable(self, node: TreeNode) -> bool:
        """Whether ``match_prefix`` may use ``node`` (tiers override: device-resident only)."""
        return True

    def _on_matched(self, node: TreeNode) -> None:
        """Called on each node ``match_prefix`` uses, after its hit is counted."""

    def peek_prefix(self, key: list[int], extra_key: Hashable = None) -> tuple[int, TreeNode]:
        """Read-only ``match_prefix``: the cached page-aligned prefix length of ``key`` and the
        deepest node matched in full (a partial edge counts in the length only). Changes
        nothing: no split, no hit, no clock tick (schedule policies call it)."""
        key_t = tuple(key[: self._aligned(len(key))])
        node, length = self.root, 0
        while key_t:
            child = node.children.get(self._child_key(key_t, extra_key, node))
            if child is None:
                break
            n = self._common(child.key, key_t)
            length += n
            if n < len(child.key):
                break
            node, key_t = child, key_t[n:]
        return length, node

    def cached_path(self, key: list[int], extra_key: Hashable = None) -> tuple[list[int], TreeNode]:
        """The slots and last node of ``key``, which must be cached in full and end on a node
        boundary (as right after inserting it). Counts no hit: a request re-locking what it
        just inserted is not a reuse."""
        length, node = self.peek_prefix(key, extra_key)
        if length != len(key) or (node is self.root and key):
            raise AssertionError("cached_path: the key is not cached up to a node boundary")
        parts, n = [], node
        while n is not self.root:
            parts.append(n.value)
            n = n.parent
        return [s for part in reversed(parts) for s in part], node

    def insert(
        self, key: list[int], value: list[int], extra_key: Hashable = None, priority: int = 0
    ) -> int:
        """Cache ``value`` (slots) for ``key``; returns how many leading tokens were already
        cached. Those duplicate slots stay the caller's to free; the rest now belong to the
        tree. Only the page-aligned part is inserted (the caller keeps the tail's slots)."""
        if len(key) != len(value):
            raise ValueError(f"key and value differ in length: {len(key)} vs {len(value)}")
        now = self._tick()
        n_aligned = self._aligned(len(key))
        key_t, value = tuple(key[:n_aligned]), list(value[:n_aligned])
        node, done = self.root, 0
        while key_t:
            ck = self._child_key(key_t, extra_key, node)
            child = node.children.get(ck)
            if child is None:
                node = self._add_leaf(node, ck, key_t, value, extra_key, priority, now)
                break
            n = self._common(child.key, key_t)
            if n < len(child.key):
                child = self._split(child, n, now)
            self._touch(child, now, hit=False)
            child.priority = max(child.priority, priority)
            done += n
            node, key_t, value = child, key_t[n:], value[n:]
        # A node's priority is the max over the requests that used its subtree.
        while node.parent is not None and node.parent is not self.root:
            node.parent.priority = max(node.parent.priority, node.priority)
            node = node.parent
        return done

    def cache(
        self, key: list[int], value: list[int], extra_key: Hashable = None, priority: int = 0
    ) -> list[int]:
        """Insert a request's KV (``value``: its slots for ``key``); returns the slots the tree
        did not take, which the caller frees (duplicates of what was already cached, and the
        tail past the last full page)."""
        done = self.insert(key, value, extra_key, priority)
        return list(value[:done]) + list(value[self._aligned(len(key)) :])

    def flush(self) -> None:
        """Drop everything unlocked (``/flush_cache``)."""
        self.evict(self.total_size)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release background resources (the hierarchical cache's storage writer)."""

    def _add_leaf(self, node, ck, key_t, value, extra_key, priority, now) -> TreeNode:
        new = TreeNode(node, key_t, value, extra_key, now)
        new.priority = priority
        node.children[ck] = new
        self.evictable_size += len(key_t)
        self.policy.on_insert(new)
        return new

    def _split(self, child: TreeNode, n: int, now: float) -> TreeNode:
        """Split ``child`` after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        upper = TreeNode(parent, child.key[:n], None, child.extra_key, now)
        upper.value = child.value[:n] if child.value is not None else None
        if child.host_kv is not None:  # [layers, 2, tokens, heads, dim]: split along tokens
            upper.host_kv = child.host_kv[:, :, :n]
            child.host_kv = child.host_kv[:, :, n:]
        upper.pending = child.pending
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.last_access_time = child.last_access_time
        upper.creation_time = child.creation_time
        upper.priority = child.priority
        parent.children[self._child_key(child.key, child.extra_key, parent)] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:] if child.value is not None else None
        upper.children[self._child_key(child.key, child.extra_key, upper)] = child
        self.policy.on_insert(upper)
        return upper

    # ---- locking --------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin the path root..node (a running request uses it)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            if node.lock_ref <= 0:
                raise AssertionError(f"unbalanced dec_lock_ref on {node}")
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction -------------------------------------------------------------------------

    def _evictable_leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.is_leaf and node.lock_ref == 0:
                out.append(node)
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, smallest policy key first
        (ties: older node first). Returns the number freed (less if not enough is evictable).
        ``evict(0)`` does nothing."""
        heap: list[tuple[Any, int, TreeNode]] = [
            (self.policy.key(n), n.id, n) for n in self._evictable_leaves()
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.free_slots(list(node.value))
            freed += len(node.value)
            self.num_evicted_tokens += len(node.value)
            self.evictable_size -= len(node.key)
            parent = node.parent
            del parent.children[self._child_key(node.key, node.extra_key, parent)]
            self.policy.on_remove(node)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        return freed

    # ---- checks ---------------------------------------------------------------------------

    def all_slots(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out += node.value
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        evictable = protected = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node, "broken parent link"
                assert child.key and len(child.key) == len(child.value), "bad edge"
                assert ck == self._child_key(child.key, child.extra_key, node), "bad child key"
                assert len(child.key) % self.page_size == 0, "edge not page-aligned"
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                    assert all(c.lock_ref == 0 for c in child.children.values()), (
                        "a locked node under an unlocked one"
                    )
                stack.append(child)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            "sizes do not add up"
        )
        slots = self.all_slots()
        assert len(slots) == len(set(slots)), "a slot is in the tree twice"
