"""The radix tree and every built-in eviction policy (the scheduler does not use them yet)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom import plugins
from loom.mem_cache.eviction import LRUPolicy
from loom.mem_cache.radix_cache import RadixCache


def _cache(policy="lru", page_size=1, **options):
    freed: list[int] = []
    pol = plugins.resolve("radix_eviction_policy", policy)(**options)
    return RadixCache(freed.extend, pol, page_size), freed


def test_match_split_and_duplicate_insert():
    c, _ = _cache()
    assert c.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    slots, node = c.match_prefix([1, 2, 3, 9])
    assert slots == [10, 11, 12] and node.key == (1, 2, 3)  # the edge was split at 3
    assert c.insert([1, 2, 5], [20, 21, 22]) == 2  # [1, 2] was cached: 20, 21 stay the caller's
    assert c.match_prefix([1, 2, 5, 6])[0] == [10, 11, 22]
    assert c.total_size == 5
    c.check()


def test_namespaces_never_share():
    c, _ = _cache()
    c.insert([1, 2, 3], [10, 11, 12], extra_key="adapter-a")
    assert c.match_prefix([1, 2, 3], extra_key="adapter-b")[0] == []
    assert c.match_prefix([1, 2, 3])[0] == []
    assert c.match_prefix([1, 2, 3], extra_key="adapter-a")[0] == [10, 11, 12]
    c.check()


def test_page_aligned_keys():
    c, _ = _cache(page_size=4)
    assert c.insert(list(range(10)), list(range(100, 110))) == 0
    assert c.total_size == 8  # the last partial page is not cached
    assert c.match_prefix(list(range(7)))[0] == [100, 101, 102, 103]
    c.insert([0, 1, 2, 3, 9, 9, 9, 9], [200, 201, 202, 203, 204, 205, 206, 207])
    c.check()  # the split happened on the page boundary


def test_locked_paths_are_never_evicted():
    c, freed = _cache()
    c.insert([1, 2, 3], [10, 11, 12])
    c.insert([5, 6], [20, 21])
    _, node = c.match_prefix([1, 2, 3])
    c.inc_lock_ref(node)
    assert (c.evictable_size, c.protected_size) == (2, 3)
    assert c.evict(100) == 2 and sorted(freed) == [20, 21]
    assert c.evict(0) == 0
    c.dec_lock_ref(node)
    assert c.evict(100) == 3
    assert c.total_size == 0
    c.check()


# A scripted history whose victim order differs for every policy. Node stats after it
# (logical clock: one tick per insert/match; an insert touches without a hit):
#   1: created t1, priority 2, hits 1 (t12), last t12
#   2: created t2, priority 0, hits 1 (t7),  last t7
#   3: created t3, priority 1, hits 4 (t5, t6, t9, t10), last t10
#   4: created t4, priority 3, hits 0,       last t11 (re-insert)
EXPECTED = {
    "lru": [2, 3, 4, 1],  # last access 7, 10, 11, 12
    "lfu": [4, 2, 1, 3],  # hits 0; 1 (last 7); 1 (last 12); 4
    "fifo": [1, 2, 3, 4],  # creation order
    "mru": [1, 4, 3, 2],  # last access 12, 11, 10, 7
    "filo": [4, 3, 2, 1],  # newest first
    "priority": [2, 3, 1, 4],  # priority 0, 1, 2, 3
    "slru": [2, 4, 1, 3],  # probationary (hits < 2) by recency 7, 11, 12; then protected 3
}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_victim_order(policy):
    c, freed = _cache(policy)
    for token, prio in [(1, 2), (2, 0), (3, 1), (4, 3)]:
        c.insert([token], [100 + token], priority=prio)
    for op, token in [
        ("m", 3),
        ("m", 3),
        ("m", 2),
        ("i", 3),
        ("m", 3),
        ("m", 3),
        ("i", 4),
        ("m", 1),
    ]:
        c.match_prefix([token]) if op == "m" else c.insert([token], [100 + token])
    order = []
    while c.total_size:
        c.evict(1)
        order.append(freed[-1] - 100)
    assert order == EXPECTED[policy]


def test_slru_threshold_flag_reaches_the_policy():
    import loom

    with loom.Engine(
        max_total_tokens=1024, radix_eviction_policy="slru", slru_protected_threshold=5
    ) as e:
        assert e.scheduler.cache.tree.policy.protected_threshold == 5
        out = e.generate("Hello", {"max_new_tokens": 2, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 2


def test_every_builtin_policy_has_an_expected_order():
    builtin = {e.name for e in plugins.entries("radix_eviction_policy") if e.origin == "built-in"}
    assert builtin == set(EXPECTED)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
        st.lists(st.integers(0, 3), min_size=1, max_size=6),
        st.integers(0, 8),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, page_size=st.sampled_from([1, 2]))
def test_invariants_under_random_operations(ops, page_size):
    """Sizes add up, locked nodes survive, and every slot is free, in the tree or held by a
    request (here: the insert's duplicates, which the test gives back at once)."""
    pool = set(range(1000))
    free: set[int] = set(pool)
    c = RadixCache(lambda slots: free.update(slots), LRUPolicy(), page_size)
    locks = []
    for op, key, n in ops:
        if op == "insert":
            slots = sorted(free)[: len(key)]
            if len(slots) < len(key):
                continue
            free.difference_update(slots)
            done = c.insert(key, slots)
            kept = len(key) - len(key) % page_size
            free.update(slots[:done])  # duplicates of cached tokens
            free.update(slots[kept:])  # the unaligned tail is not cached
        elif op == "match":
            c.match_prefix(key)
        elif op == "lock":
            _, node = c.match_prefix(key)
            c.inc_lock_ref(node)
            locks.append(node)
        elif op == "unlock" and locks:
            c.dec_lock_ref(locks.pop(n % len(locks)))
        elif op == "evict":
            locked = {s for node in locks for s in _path_slots(c, node)}
            c.evict(n)
            assert locked <= set(c.all_slots())  # nothing locked was evicted
        c.check()
        in_tree = c.all_slots()
        assert free.isdisjoint(in_tree)
        assert free | set(in_tree) == pool


def _path_slots(c: RadixCache, node) -> list[int]:
    out = []
    while node is not c.root:
        out += node.value
        node = node.parent
    return out
