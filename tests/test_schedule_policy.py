"""Schedule policies: exact admission orders on a scripted radix tree (hand-computed)."""

from __future__ import annotations

import pytest

from loom import plugins
from loom.mem_cache.eviction import LRUPolicy
from loom.mem_cache.radix_cache import RadixCache
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.policy import LPM_FALLBACK_QUEUE_LEN, NoPrefixCache
from loom.scheduler.request import Req


class View:
    """The scheduler's PrefixView over a bare tree (match on all tokens but the last)."""

    def __init__(self, tree):
        self.tree = tree

    def match(self, req):
        return self.tree.peek_prefix(req.fill_ids[:-1], req.extra_key)


@pytest.fixture
def setup():
    tree = RadixCache(lambda slots: None, LRUPolicy())
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([1, 2, 5, 6], [10, 11, 14, 15])  # splits [1,2,3,4] into [1,2] -> {[3,4],[5,6]}
    tree.insert([7, 8], [16, 17])
    reqs = {
        "r0": Req("r0", [9, 9, 9], SamplingParams(max_new_tokens=5), priority=1),
        "r1": Req("r1", [1, 2, 3, 4, 10], SamplingParams(max_new_tokens=50), priority=0),
        "r2": Req("r2", [1, 2, 5, 11], SamplingParams(max_new_tokens=20), priority=3),
        "r3": Req("r3", [7, 8, 1], SamplingParams(max_new_tokens=20), priority=3),
        "r4": Req("r4", [1, 2, 3, 4, 12, 13], SamplingParams(max_new_tokens=1), priority=-2),
    }
    return tree, reqs


def _order(name, tree, reqs, **kw):
    policy = plugins.resolve("schedule_policy", name)(**kw)
    return [r.rid for r in policy.order(list(reqs.values()), View(tree))]


def test_peek_prefix_changes_nothing(setup):
    tree, _ = setup
    before = [(n.key, n.hit_count, n.last_access_time) for n in tree.root.children.values()]
    assert tree.peek_prefix([1, 2, 5])[0] == 3  # partial edge [5, 6] counts in the length
    assert tree.peek_prefix([1, 2, 3, 4, 9])[0] == 4
    assert tree.peek_prefix([1, 2, 3, 4], extra_key="salt")[0] == 0
    after = [(n.key, n.hit_count, n.last_access_time) for n in tree.root.children.values()]
    assert before == after
    tree.check()


def test_fcfs(setup):
    assert _order("fcfs", *setup) == ["r0", "r1", "r2", "r3", "r4"]


def test_lpm(setup):
    # matched lengths: r0 0, r1 4, r2 3 (into the [5, 6] edge), r3 2, r4 4; stable on ties
    assert _order("lpm", *setup) == ["r1", "r4", "r2", "r3", "r0"]


def test_dfs_weight(setup):
    # weights: [1,2] 3 (r1, r2, r4), [3,4] 2 (r1, r4), [7,8] 1 (r3). Depth first, heaviest first:
    # [1,2]'s own request r2, then [3,4]'s r1 and r4, then [7,8]'s r3; unmatched r0 last.
    assert _order("dfs-weight", *setup) == ["r2", "r1", "r4", "r3", "r0"]


def test_lof(setup):
    assert _order("lof", *setup) == ["r1", "r2", "r3", "r0", "r4"]


def test_priority(setup):
    assert _order("priority", *setup) == ["r2", "r3", "r0", "r1", "r4"]


def test_random_is_a_seeded_permutation(setup):
    a = _order("random", *setup, seed=3)
    assert sorted(a) == ["r0", "r1", "r2", "r3", "r4"]
    assert a == _order("random", *setup, seed=3)
    assert len({tuple(_order("random", *setup, seed=s)) for s in range(8)}) > 1


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_cache_aware_policies_fall_back_to_fcfs_on_long_queues(setup, name):
    tree, reqs = setup
    many = {f"x{i}": Req(f"x{i}", [1, 2, 3, 4, i + 100], SamplingParams()) for i in range(200)}
    many = {"first": Req("first", [9, 9], SamplingParams()), **many}
    assert len(many) > LPM_FALLBACK_QUEUE_LEN
    assert _order(name, tree, many) == list(many)


def test_no_prefix_cache_view(setup):
    _, reqs = setup
    policy = plugins.resolve("schedule_policy", "lpm")()
    assert [r.rid for r in policy.order(list(reqs.values()), NoPrefixCache())] == list(reqs)
