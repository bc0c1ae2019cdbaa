"""The radix cache end to end on a tiny random Llama: greedy outputs are identical with the
cache on or off, under every eviction policy and every schedule policy, on a shared-prefix
workload and on multi-turn chats, with chunked prefill and a pool small enough to evict."""

from __future__ import annotations

import random

import pytest

import loom
from loom import plugins
from tests.conftest import save_tiny_llama

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-prefix"), initializer_range=0.2)


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(45)]
    shared = [system + [rng.randrange(3, 500) for _ in range(rng.randint(3, 9))] for _ in range(10)]
    # multi-turn: each turn's prompt extends the previous one (the previous reply is appended
    # by the test from the actual output, as a chat client would)
    turns = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 10))] for _ in range(4)]
    return shared, turns


def _run(engine, shared, turns):
    outs = engine.generate(input_ids=shared, sampling_params=PARAMS)
    shared_out = [o["output_ids"] for o in outs]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    again = engine.generate(input_ids=shared[:3], sampling_params=PARAMS)
    convo, chat_out, chat_cached = [], [], []
    for t in turns:
        convo = convo + t
        o = engine.generate(input_ids=convo, sampling_params=PARAMS)
        chat_out.append(o["output_ids"])
        chat_cached.append(o["meta_info"]["cached_tokens"])
        convo = convo + o["output_ids"]
    engine.scheduler.check_kv_balance()
    return {
        "shared": shared_out,
        "again": [o["output_ids"] for o in again],
        "again_cached": [o["meta_info"]["cached_tokens"] for o in again],
        "chat": chat_out,
        "cached": cached,
        "chat_cached": chat_cached,
    }


KW = dict(
    max_total_tokens=200, chunked_prefill_size=16, max_running_requests=4, skip_tokenizer_init=True
)


@pytest.fixture(scope="module")
def reference(tiny, workload):
    with loom.Engine(model=tiny, disable_radix_cache=True, **KW) as e:
        return _run(e, *workload)


def _check(got, want, page_size, workload):
    shared, _ = workload
    assert got["shared"] == want["shared"]
    assert got["again"] == want["shared"][:3]
    assert got["chat"] == want["chat"]
    # repeated requests hit (in a pool this small, not necessarily in full)
    assert sum(got["again_cached"]) > 0
    # later turns of a chat reuse the earlier turns' KV
    assert all(c > 0 for c in got["chat_cached"][1:])


@pytest.mark.parametrize("policy", plugins.names("radix_eviction_policy"))
def test_every_eviction_policy_keeps_outputs(tiny, workload, reference, policy):
    with loom.Engine(model=tiny, radix_eviction_policy=policy, page_size=4, **KW) as e:
        got = _run(e, *workload)
        assert e.scheduler.cache.tree.num_evicted_tokens > 0  # the pool is small enough to evict
    _check(got, reference, 4, workload)
    assert sum(got["cached"]) > 0


@pytest.mark.parametrize("policy", plugins.names("radix_eviction_policy"))
def test_repeat_hits_up_to_its_last_page(tiny, workload, policy):
    """With room to spare, a second identical request reports cached tokens >= its prompt
    minus one page (the last token is always computed)."""
    shared, _ = workload
    with loom.Engine(
        model=tiny, radix_eviction_policy=policy, page_size=4, max_total_tokens=4096,
        skip_tokenizer_init=True,
    ) as e:  # fmt: skip
        first = e.generate(input_ids=shared, sampling_params=PARAMS)
        again = e.generate(input_ids=shared, sampling_params=PARAMS)
    for ids, a, b in zip(shared, first, again, strict=True):
        assert b["meta_info"]["cached_tokens"] >= len(ids) - 4
        assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("policy", plugins.names("schedule_policy"))
def test_every_schedule_policy_keeps_outputs(tiny, workload, reference, policy):
    with loom.Engine(model=tiny, schedule_policy=policy, **KW) as e:
        got = _run(e, *workload)
    _check(got, reference, 1, workload)


def test_chunked_prefill_inserts_as_it_goes(tiny):
    """A long prompt is inserted chunk by chunk: while it is still prefilling, the tree already
    holds its first chunks (locked by it), and at the end everything balances."""
    prompt = list(range(3, 3 + 100))
    with loom.Engine(
        model=tiny, max_total_tokens=1024, chunked_prefill_size=16, skip_tokenizer_init=True
    ) as e:
        sched = e.scheduler
        seen = []
        orig = sched.cache.cache_unfinished

        def spy(req):
            orig(req)
            seen.append((req.kv_len, sched.cache.tree.protected_size, req.num_shared_pages))

        sched.cache.cache_unfinished = spy
        out = e.generate(input_ids=prompt, sampling_params=PARAMS)
        again = e.generate(input_ids=prompt[:60] + [7, 7], sampling_params=PARAMS)
        sched.check_kv_balance()
    # every chunk is inserted as it is computed, and the whole prompt when its prefill ends
    assert [s[0] for s in seen[:7]] == [16, 32, 48, 64, 80, 96, 100]
    assert all(prot >= kv and shared == kv for kv, prot, shared in seen[:7])
    assert out["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 60


def test_extra_key_namespaces_the_cache(tiny):
    prompt = list(range(5, 45))
    with loom.Engine(model=tiny, max_total_tokens=1024, skip_tokenizer_init=True) as e:
        a = e.generate(input_ids=prompt, sampling_params=PARAMS, extra_key="alice")
        b = e.generate(input_ids=prompt, sampling_params=PARAMS, extra_key="bob")
        a2 = e.generate(input_ids=prompt, sampling_params=PARAMS, extra_key="alice")
        plain = e.generate(input_ids=prompt, sampling_params=PARAMS)
        e.scheduler.check_kv_balance()
        with pytest.raises(ValueError, match="extra_key"):
            e.generate(input_ids=prompt, sampling_params=PARAMS, extra_key=3)
        with pytest.raises(ValueError, match="priority"):
            e.generate(input_ids=prompt, sampling_params=PARAMS, priority="high")
    assert [x["meta_info"]["cached_tokens"] for x in (a, b, a2, plain)] == [0, 0, 39, 0]
    assert a["output_ids"] == b["output_ids"] == a2["output_ids"] == plain["output_ids"]


def test_mixed_chunk_keeps_outputs(tiny):
    """--enable-mixed-chunk: running requests decode inside later prefill batches (long
    prompts prefill in chunks of 32); greedy outputs are unchanged."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 120))] for _ in range(8)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    kw = dict(model=tiny, skip_tokenizer_init=True, max_total_tokens=2048, chunked_prefill_size=32)
    with loom.Engine(**kw) as e:
        want = [e.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    with loom.Engine(enable_mixed_chunk=True, **kw) as e:
        # One chunked prefill at a time: the requests admitted before it decode inside its
        # chunks' batches.
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
        assert e.scheduler.stats.num_mixed_batches > 0
        e.scheduler.check_kv_balance()
    assert got == want
