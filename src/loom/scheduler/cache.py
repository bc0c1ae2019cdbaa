"""The cache manager: the KV page allocator, the request-to-token rows and the prefix tree, and
every change a request makes to them.

A request's KV: positions ``[0, kv_len)`` live in its pages ``kv_pages`` (its row
``req_pool_idx`` of the request-to-token table maps each position to a slot). The first
``num_shared_pages`` of them belong to the prefix tree (a matched or inserted prefix, locked
through ``prefix_node`` while the request holds it); the rest are its own.

Invariant (``check_balance``): every page is free, owned by exactly one request, or held by the
tree.
"""

from __future__ import annotations

import contextlib

from loom.forward_batch import int64_tensor
from loom.mem_cache.builder import build_prefix_cache
from loom.mem_cache.memory_pool import PageAllocator, ReqToTokenPool
from loom.scheduler.base import NoPrefixCache


class CacheManager:
    """``allocator``: the page allocator; ``req_to_token_pool``: the request rows; ``tree``:
    the prefix cache (None: off), which gives slots back through ``free_tree_slots`` and takes
    them through ``alloc_tree_slots``."""

    def __init__(self, allocator, req_to_token_pool, page_size: int) -> None:
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = page_size
        self.tree = None

    @classmethod
    def for_runner(cls, args, runner) -> CacheManager:
        """The allocator and the request rows for the model runner's capacity (its KV pool's
        pages, its running limit), bound to the runner, with the prefix cache ``args`` (the
        server arguments) ask for."""
        allocator = PageAllocator(runner.num_pages, args.page_size)
        # +1 spare row so a request can be set up while max_running are active (retraction).
        rows = ReqToTokenPool(
            runner.max_running_requests + 1, runner.model_config.context_len, runner.device
        )
        runner.bind(rows)
        cache = cls(allocator, rows, args.page_size)
        cache.tree = build_prefix_cache(
            args.cache_args,
            args.model_args,
            runner.kv_pool,
            runner.model_config,
            runner.max_total_tokens,
            cache.free_tree_slots,
            cache.alloc_tree_slots,
        )
        return cache

    def close(self) -> None:
        if self.tree is not None:
            self.tree.close()

    @contextlib.contextmanager
    def without_tree(self):
        """Run with no prefix cache (the warm-up: nothing of it may reach a cache tier, and the
        hierarchical cache's storage persists across restarts)."""
        tree, self.tree = self.tree, None
        try:
            yield
        finally:
            self.tree = tree

    # ---- pages and slots ------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def evictable_pages(self) -> int:
        return self.tree.evictable_size // self.page_size if self.tree is not None else 0

    def alloc_pages(self, n: int) -> list[int] | None:
        """``n`` pages, evicting unlocked tree leaves if the allocator runs short."""
        if n > self.allocator.num_free and self.tree is not None:
            self.tree.evict((n - self.allocator.num_free) * self.page_size)
        return self.allocator.alloc(n)

    def free_by_evicting(self, need: int) -> bool:
        """Whether ``need`` pages are free, after evicting cached prefixes nobody is using if
        they were not."""
        short = need - self.allocator.num_free
        if short > 0 and self.evictable_pages() > 0:
            self.tree.evict(short * self.page_size)
        return need <= self.allocator.num_free

    def alloc_tree_slots(self, num_tokens: int) -> list[int] | None:
        ps = self.page_size
        pages = self.alloc_pages(num_tokens // ps)
        if pages is None:
            return None
        return [p * ps + i for p in pages for i in range(ps)]

    def free_tree_slots(self, slots: list[int]) -> None:
        ps = self.page_size
        self.allocator.free(sorted({s // ps for s in slots}))

    def has_free_row(self) -> bool:
        return self.req_to_token_pool.num_free > 0

    def alloc_row(self, req) -> None:
        req.req_pool_idx = self.req_to_token_pool.alloc()

    def alloc_kv(self, req, num_tokens: int, write: bool = True) -> list[int] | None:
        """Slots for positions [kv_len, kv_len + num_tokens) of ``req``; None if out of pages.

        With ``write`` they are also written into the request's row of the req-to-token table;
        decode leaves that to the model runner, which writes the whole batch in one copy."""
        ps = self.page_size
        start, end = req.kv_len, req.kv_len + num_tokens
        need = -(-end // ps) - len(req.kv_pages)
        if need > 0:
            pages = self.alloc_pages(need)
            if pages is None:
                return None
            req.kv_pages.extend(pages)
        pages = req.kv_pages
        locs = [pages[p // ps] * ps + p % ps for p in range(start, end)]
        if write:
            self._write_row(req, start, locs)
        return locs

    def alloc_next_slots(self, reqs) -> list[int] | None:
        """One slot per request for its next position (``kv_len``), not written into the
        table; None if out of pages. The same pages as ``alloc_kv(req, 1, write=False)`` per
        request in turn, from one allocator call (a decode step's rows, on the host's path
        between steps)."""
        ps = self.page_size
        short = [r for r in reqs if r.kv_len // ps >= len(r.kv_pages)]
        if short:
            pages = self.alloc_pages(len(short))
            if pages is None:
                return None
            for req, page in zip(short, pages, strict=True):
                req.kv_pages.append(page)
        return [r.kv_pages[r.kv_len // ps] * ps + r.kv_len % ps for r in reqs]

    def write_slots(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """Record one slot per (request row, position) in the req-to-token table, in one copy."""
        table = self.req_to_token_pool.req_to_token
        packed = int64_tensor([*rows, *positions, *slots]).view(3, len(rows))
        r, p, s = packed.to(table.device, non_blocking=True).unbind(0)
        table[r, p] = s
        self.req_to_token_pool.dirty.update(rows)

    def _write_row(self, req, start: int, slots: list[int]) -> None:
        table = self.req_to_token_pool.req_to_token
        self.req_to_token_pool.dirty.add(req.req_pool_idx)
        table[req.req_pool_idx, start : start + len(slots)] = int64_tensor(slots).to(
            table.device, non_blocking=True
        )

    def release(self, req, cache: bool = False) -> None:
        """Give back the request's KV and row. With ``cache`` (and a tree), its computed KV is
        inserted into the tree, which takes the pages it did not already hold; every other own
        page returns to the allocator. The matched prefix is unlocked."""
        ps = self.page_size
        own = req.kv_pages[req.num_shared_pages :]
        first_own = req.num_shared_pages  # page index of own[0] within the request
        if own and self.tree is not None and cache and req.req_pool_idx is not None:
            n = req.kv_len - req.kv_len % ps
            if n > 0:
                dup = self._insert_computed(req, n)
                # The tree took our full pages but the duplicates; the partial page past n is
                # ours to free too.
                self.allocator.free(
                    [p for i, p in enumerate(own, first_own) if i >= n // ps or p in dup]
                )
                own = []
        if own:
            self.allocator.free(own)
        if req.prefix_node is not None:
            self.tree.dec_lock_ref(req.prefix_node)
            req.prefix_node = None
        req.kv_pages = []
        req.num_shared_pages = 0
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        req.kv_len = 0

    # ---- the prefix tree ------------------------------------------------------------------

    def _insert_computed(self, req, n: int) -> set[int]:
        """Insert the request's first ``n`` (page-aligned) tokens' KV into the tree; returns the
        pages the tree did not take (duplicates of what it already held)."""
        ps = self.page_size
        # From the request's pages, as alloc_kv laid them out: reading its row of the device
        # table would wait for every step queued, under overlap the in-flight one too.
        pages = req.kv_pages
        slots = [pages[i // ps] * ps + i % ps for i in range(n)]
        back = self.tree.cache(req.fill_ids[:n], slots, req.extra_key, req.priority)
        return {s // ps for s in back}

    def cache_unfinished(self, req) -> None:
        """After a prefill (a chunk, or the whole prompt) the request inserts what it has
        computed, so that requests sharing the prefix can match it before this one finishes; it
        then holds the tree's path (locked) instead of its own pages for that part."""
        if self.tree is None:
            return
        ps = self.page_size
        n = req.kv_len - req.kv_len % ps
        if n <= req.num_shared_pages * ps:
            return
        back = self._insert_computed(req, n)
        # Own pages the tree did not take duplicate what another request cached meanwhile.
        dup = [
            p
            for i, p in enumerate(req.kv_pages)
            if req.num_shared_pages <= i < n // ps and p in back
        ]
        new_slots, node = self.tree.cached_path(req.fill_ids[:n], req.extra_key)
        self.tree.inc_lock_ref(node)
        if req.prefix_node is not None:
            self.tree.dec_lock_ref(req.prefix_node)
        req.prefix_node = node
        self.allocator.free(dup)
        req.kv_pages = [s // ps for s in new_slots[::ps]] + req.kv_pages[n // ps :]
        req.num_shared_pages = n // ps
        if dup:
            self._write_row(req, 0, new_slots)

    @property
    def prefix_view(self):
        """What schedule policies may ask (``PrefixView``)."""
        return self if self.tree is not None else NoPrefixCache()

    @property
    def loads_on_match(self) -> bool:
        """Whether matching may bring KV back from a lower tier (the hierarchical cache), so
        that a read-only peek does not tell what a match will give."""
        return hasattr(self.tree, "match_and_load")

    def match(self, req) -> tuple[int, object]:
        """The schedule policies' read-only view of the prefix cache (``PrefixView``)."""
        return self.tree.peek_prefix(req.fill_ids[: req.seq_len - 1], req.extra_key)

    def lookup(self, req) -> tuple[list[int], object]:
        """The cached prefix of the request's tokens (loaded from a lower tier where the tree
        has one), leaving at least one token to compute."""
        if self.tree is None:
            return [], None
        key = req.fill_ids[: req.seq_len - 1]
        if req.wants_input_logprobs:  # prompt logprobs need the logits from logprob_start_len - 1
            key = key[: max(req.logprob_start_len - 1, 0)]
        if self.loads_on_match:
            return self.tree.match_and_load(key, req.extra_key)
        return self.tree.match_prefix(key, req.extra_key)

    def use_prefix(self, req, slots: list[int], node) -> None:
        """Start the request on a matched prefix: lock it and point its table row at it."""
        req.cached_tokens = len(slots)
        if not slots:
            return
        ps = self.page_size
        self.tree.inc_lock_ref(node)
        req.prefix_node = node
        req.kv_pages = [s // ps for s in slots[::ps]]
        req.num_shared_pages = len(req.kv_pages)
        req.kv_len = len(slots)
        self._write_row(req, 0, slots)

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.flush()

    def check_balance(self, owners) -> None:
        """``owners``: every request that may hold pages."""
        owned = sum(len(r.kv_pages) - r.num_shared_pages for r in owners)
        if self.tree is not None:
            owned += self.tree.total_size // self.page_size
        free = self.allocator.num_free
        if free + owned != self.allocator.num_pages:
            raise AssertionError(
                f"KV pages do not balance: {free} free + {owned} owned != "
                f"{self.allocator.num_pages}"
            )
