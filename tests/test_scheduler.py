"""Continuous batching: batch invariance under chunked prefill, paging and retraction; KV balance;
aborts; streaming."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import loom
from tests.conftest import CHAT_PROMPTS, chat_ids

PARAMS = {"max_new_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def prompts_ids(engine):
    return [chat_ids(engine, p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def reference(engine, prompts_ids):
    """Greedy outputs generated one request at a time."""
    return [
        engine.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"] for ids in prompts_ids
    ]


def _assert_balanced(e) -> None:
    """Idle: every page is free or held by the radix cache, and nothing is locked."""
    sched = e.scheduler
    sched.check_kv_balance()
    cached = (
        sched.cache.tree.total_size // sched.cache.page_size if sched.cache.tree is not None else 0
    )
    assert sched.cache.allocator.num_free + cached == sched.cache.allocator.num_pages
    assert sched.cache.tree is None or sched.cache.tree.protected_size == 0
    assert sched.cache.req_to_token_pool.num_free == sched.cache.req_to_token_pool.size


def test_all_together_equals_one_at_a_time(engine, prompts_ids, reference):
    outs = engine.generate(input_ids=prompts_ids, sampling_params=PARAMS)
    assert [o["output_ids"] for o in outs] == reference
    _assert_balanced(engine)


@pytest.mark.parametrize(
    "flags",
    [
        {"chunked_prefill_size": 16},
        {"page_size": 4, "chunked_prefill_size": 16},
        {"max_running_requests": 3},
    ],
    ids=["chunked16", "page4", "max-running-3"],
)
def test_batch_invariance(flags, prompts_ids, reference):
    with loom.Engine(max_total_tokens=8192, **flags) as e:
        outs = e.generate(input_ids=prompts_ids, sampling_params=PARAMS)
        assert [o["output_ids"] for o in outs] == reference
        _assert_balanced(e)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_greedy_output(page_size, prompts_ids, reference):
    # A pool that holds about three requests, admitted greedily: decode must retract.
    total = max(len(i) for i in prompts_ids) * 3 + 64
    with loom.Engine(
        max_total_tokens=total, page_size=page_size, schedule_conservativeness=0.0
    ) as e:
        outs = e.generate(input_ids=prompts_ids, sampling_params=PARAMS)
        assert e.scheduler.stats.num_retractions > 0
        assert [o["output_ids"] for o in outs] == reference
        _assert_balanced(e)


def test_abort_mid_stream_frees_pages(engine, prompts_ids):
    stream = engine.generate(
        input_ids=prompts_ids[0],
        sampling_params={"max_new_tokens": 200, "temperature": 0, "ignore_eos": True},
        stream=True,
    )
    got = [next(stream) for _ in range(3)]
    assert all(g["meta_info"]["finish_reason"] is None for g in got)
    stream.close()  # the caller goes away: the request is aborted
    # the next request runs after the abort was applied; then every page is back
    engine.generate(input_ids=prompts_ids[1], sampling_params={"max_new_tokens": 2})
    _assert_balanced(engine)


def test_stream_concatenates_to_text(engine, prompts_ids):
    full = engine.generate(input_ids=prompts_ids[3], sampling_params=PARAMS)
    parts = list(engine.generate(input_ids=prompts_ids[3], sampling_params=PARAMS, stream=True))
    assert "".join(p["text"] for p in parts) == full["text"]
    assert [t for p in parts for t in p["output_ids"]] == full["output_ids"]
    assert parts[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_async_generate(engine, prompts_ids, reference):
    async def main():
        single = await engine.async_generate(input_ids=prompts_ids[0], sampling_params=PARAMS)
        stream = await engine.async_generate(
            input_ids=prompts_ids[1], sampling_params=PARAMS, stream=True
        )
        ids = [t async for inc in stream for t in inc["output_ids"]]
        both = await asyncio.gather(
            *[engine.async_generate(input_ids=p, sampling_params=PARAMS) for p in prompts_ids[2:4]]
        )
        return single, ids, both

    single, ids, both = asyncio.run(main())
    assert single["output_ids"] == reference[0]
    assert ids == reference[1]
    assert [b["output_ids"] for b in both] == reference[2:4]


def test_meta_info_shape(engine, prompts_ids):
    out = engine.generate(
        input_ids=prompts_ids[0],
        sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompts_ids[0])
    assert meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert len(out["output_ids"]) == 3


def test_stop_token_ids_and_stop_strings(engine, prompts_ids, reference):
    ref = reference[0]  # "The capital of France is Paris."
    out = engine.generate(
        input_ids=prompts_ids[0], sampling_params={"temperature": 0, "stop_token_ids": [ref[2]]}
    )
    assert out["output_ids"] == ref[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[2]}
    out = engine.generate(
        input_ids=prompts_ids[0], sampling_params={"temperature": 0, "stop": [" is"]}
    )
    assert out["text"] == "The capital of France"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " is"}
    _ = engine.generate(input_ids=prompts_ids[1], sampling_params={"max_new_tokens": 1})
    _assert_balanced(engine)


def test_batch_catches_each_stop_string_as_it_comes(engine, prompts_ids):
    """In a batch, outputs are consumed as they arrive, whichever request they belong to: a
    request behind a long one in the list stops on its stop string at once (the scheduler
    stops generating for it), not when the caller has finished waiting for the long one."""
    long = {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True}
    stopping = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True, "stop": [" is"]}
    before = engine.scheduler.stats.num_generated_tokens
    outs = engine.generate(
        input_ids=[prompts_ids[1], prompts_ids[0]], sampling_params=[long, stopping]
    )
    generated = engine.scheduler.stats.num_generated_tokens - before
    assert outs[1]["text"] == "The capital of France"
    assert len(outs[0]["output_ids"]) == 80
    # the stopped request ran a few tokens past its stop (steps in flight), not ~80 more
    assert generated < 80 + 20
    _assert_balanced(engine)


def test_a_batch_reaches_the_scheduler_in_one_message(engine, prompts_ids, monkeypatch):
    """A batch's requests (n > 1 samples included) are sent together, so they are all
    scheduled in the same step whatever the threads' timing: one prefill batch here (sent one
    by one, the scheduler could start on the first few alone, and the batch's grouping, hence
    its kernels' shapes and bf16 rounding, varied between runs: seen on the H200)."""
    sent = []
    real = engine.backend.send
    monkeypatch.setattr(engine.backend, "send", lambda m: (sent.append(m), real(m))[1])
    # prompts with no common prefix (shared prefixes within a batch wait a step for the
    # first one's KV)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (12 + i,), generator=g).tolist() for i in range(6)]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = engine.scheduler.stats.num_prefill_batches
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(len(o["output_ids"]) == 4 for o in outs)
    assert [(type(m).__name__, len(m.requests)) for m in sent] == [("AddRequests", 6)]
    assert engine.scheduler.stats.num_prefill_batches - before == 1
    # n > 1 samples of a prompt travel with the rest of their batch
    sent.clear()
    sampled = {**params, "n": 3, "temperature": 0.8, "seed": 1}
    outs = engine.generate(input_ids=prompts[:2], sampling_params=[params, sampled])
    assert len(outs) == 4
    assert [(type(m).__name__, len(m.requests)) for m in sent] == [("AddRequests", 4)]
    _assert_balanced(engine)


def test_a_batch_that_fails_to_submit_sends_nothing(engine, prompts_ids, monkeypatch):
    """A batch whose submission fails part way (here a duplicate request id) sends none of its
    requests and leaves no state behind."""
    sent = []
    real = engine.backend.send
    monkeypatch.setattr(engine.backend, "send", lambda m: (sent.append(m), real(m))[1])
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.generate(input_ids=prompts_ids[:2], sampling_params=PARAMS, rid=["dup", "dup"])
    assert sent == [] and not engine.router.states
    _assert_balanced(engine)


def test_a_scheduler_crash_ends_every_request_of_a_batch(prompts_ids, monkeypatch):
    """The scheduler loop dies mid-batch: every request of a batch waiting on its shared queue
    ends with an abort that names the error (none is left waiting), and the engine then
    refuses new work with the same error."""
    from loom.scheduler.scheduler import Scheduler

    real, calls = Scheduler.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("boom")
        return real(self)

    monkeypatch.setattr(Scheduler, "step", step)
    with loom.Engine(max_total_tokens=4096) as e:
        outs = e.generate(input_ids=prompts_ids[:4], sampling_params=PARAMS)
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "abort"
            assert "boom" in o["meta_info"]["error"]
            assert len(o["output_ids"]) < PARAMS["max_new_tokens"]
        with pytest.raises(RuntimeError, match="boom"):
            e.generate(input_ids=prompts_ids[0], sampling_params=PARAMS)


def test_stream_holds_back_a_stop_string_spanning_tokens(engine, prompts_ids):
    # "... France is Paris.": the stop "ce is" starts inside the token " France", so the stream
    # must hold "ce" back until it knows whether the stop string completes.
    params = {"temperature": 0, "stop": ["ce is"], "max_new_tokens": 32}
    full = engine.generate(input_ids=prompts_ids[0], sampling_params=params)
    parts = list(engine.generate(input_ids=prompts_ids[0], sampling_params=params, stream=True))
    assert full["text"] == "The capital of Fran"
    assert "".join(p["text"] for p in parts) == full["text"]
    assert parts[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "ce is"}


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_reuses_kv_with_the_same_output(prompts_ids, reference, page_size):
    with loom.Engine(max_total_tokens=8192, page_size=page_size) as e:
        first = e.generate(input_ids=prompts_ids[0], sampling_params=PARAMS)
        again = e.generate(input_ids=prompts_ids[0], sampling_params=PARAMS)
        assert first["meta_info"]["cached_tokens"] == 0
        # the whole prompt but its last token (at least one token is always computed)
        n = len(prompts_ids[0]) - 1
        assert again["meta_info"]["cached_tokens"] == n - n % page_size
        assert first["output_ids"] == again["output_ids"] == reference[0]
        # other chat prompts share the template's system prompt
        outs = e.generate(input_ids=prompts_ids[1:], sampling_params=PARAMS)
        assert all(o["meta_info"]["cached_tokens"] > 20 for o in outs)
        assert [o["output_ids"] for o in outs] == reference[1:]
        _assert_balanced(e)
        assert e.scheduler.cache.tree.total_size > 0
        e.flush_cache()
        for _ in range(100):
            if e.scheduler.cache.tree.total_size == 0:
                break
            time.sleep(0.05)
        assert e.scheduler.cache.allocator.num_free == e.scheduler.cache.allocator.num_pages


def test_cached_slots_come_from_the_pages_as_the_table_holds_them(prompts_ids, monkeypatch):
    """The radix cache takes a finishing request's slots from its pages on the host (reading
    the device table would wait for the step in flight); they are the table's, also for
    prefixes matched from the cache and for requests chunked at a page size of 4."""
    from loom.scheduler.cache import CacheManager

    seen = []
    real = CacheManager._insert_computed

    def checked(self, req, n):
        table = self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()
        ps = self.page_size
        assert [req.kv_pages[i // ps] * ps + i % ps for i in range(n)] == table
        seen.append(n)
        return real(self, req, n)

    monkeypatch.setattr(CacheManager, "_insert_computed", checked)
    with loom.Engine(max_total_tokens=8192, page_size=4, chunked_prefill_size=32) as e:
        for _ in range(2):  # the second round matches the first's prefixes
            e.generate(input_ids=prompts_ids[:3], sampling_params=PARAMS)
        assert e.get_server_info()["kv_cached_tokens"] > 0
    assert len(seen) >= 6


def test_disable_radix_cache(prompts_ids, reference):
    with loom.Engine(max_total_tokens=4096, disable_radix_cache=True) as e:
        outs = [e.generate(input_ids=prompts_ids[0], sampling_params=PARAMS) for _ in range(2)]
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
        assert outs[1]["output_ids"] == reference[0]
        assert e.scheduler.cache.allocator.num_free == e.scheduler.cache.allocator.num_pages


def test_max_new_tokens_zero(engine, prompts_ids):
    out = engine.generate(input_ids=prompts_ids[0], sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""


def _overlapped_run_matches_reference(e, prompts_ids, reference):
    """With overlap forced on (on CPU the device is synchronous, but the overlap code path runs
    all the same), the prompts generate their reference tokens, requests finishing by length
    at three different steps; the scheduler's counters after."""
    e.scheduler.overlap = True
    params = [{**PARAMS, "max_new_tokens": 48 - 5 * (i % 3)} for i in range(len(reference))]
    outs = e.generate(input_ids=prompts_ids, sampling_params=params)
    for out, ref, p in zip(outs, reference, params, strict=True):
        assert out["output_ids"] == ref[: p["max_new_tokens"]]
    return e.scheduler.stats


@pytest.mark.parametrize("tight_kv", [False, True], ids=["roomy", "retracting"])
def test_overlap_schedule_keeps_outputs(prompts_ids, reference, tight_kv):
    # On CPU the device is synchronous, but the overlap code path (launch N+1 on N's tokens,
    # resolve N afterwards, discard tokens past a finish) runs all the same.
    total = max(len(i) for i in prompts_ids) * 3 + 64 if tight_kv else 8192
    with loom.Engine(
        max_total_tokens=total, schedule_conservativeness=0.0 if tight_kv else 1.0
    ) as e:
        st = _overlapped_run_matches_reference(e, prompts_ids, reference)
        assert st.num_overlapped_batches > 10  # the chained path ran
        if tight_kv:
            assert st.num_retractions > 0
        else:
            # requests finishing (here by length, at three different steps) do not break the
            # chain: only the first decode step after each prefill runs unchained
            assert st.num_overlapped_batches >= st.num_decode_batches - st.num_prefill_batches
        _assert_balanced(e)


def test_overlap_chains_through_a_full_pool_by_evicting_cached_pages(prompts_ids, monkeypatch):
    """A pool just large enough for the requests' bounded peak: finished requests leave their
    pages in the prefix cache, so free pages run short while the cache holds plenty. A chained
    step evicts unused cached pages for its room instead of falling back to an unchained one:
    every decode step but the first after each prefill chains, nothing is retracted, outputs
    equal those generated one at a time, and the pages balance."""
    from loom.mem_cache.radix_cache import RadixCache
    from loom.scheduler.admission import peak_pages

    limits = [4 + 12 * i for i in range(len(prompts_ids))]
    params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for m in limits]
    lens = [len(p) for p in prompts_ids]
    pool = peak_pages(lens, [m + 1 for m in limits], [0] * len(lens), 1) + 2
    with loom.Engine(max_total_tokens=pool, page_size=1) as e:
        ref = [
            e.generate(input_ids=p, sampling_params=s)["output_ids"]
            for p, s in zip(prompts_ids, params, strict=True)
        ]
        e.flush_cache()
        evictions = []
        real = RadixCache.evict
        monkeypatch.setattr(
            RadixCache, "evict", lambda self, n: evictions.append(n) or real(self, n)
        )
        e.scheduler.overlap = True
        st = e.scheduler.stats
        before = (st.num_decode_batches, st.num_overlapped_batches, st.num_prefill_batches)
        retractions = st.num_retractions
        outs = e.generate(input_ids=prompts_ids, sampling_params=params)
        assert [o["output_ids"] for o in outs] == ref
        decode = st.num_decode_batches - before[0]
        chained = st.num_overlapped_batches - before[1]
        prefill = st.num_prefill_batches - before[2]
        assert evictions  # the cache had to give pages back
        assert chained >= decode - prefill
        assert st.num_retractions == retractions
        _assert_balanced(e)


def test_overlap_launches_the_next_prefill_before_applying_first_tokens(prompts_ids, reference):
    """With overlap, a prefill step launches before the previous prefill's first tokens are
    applied (its requests already count as running for admission). Prompts in 16-token chunks
    make runs of prefill steps; requests finishing on their first token, at different lengths,
    and one with prompt logprobs (applied at once) give the one-at-a-time outputs, and the pages
    balance."""
    with loom.Engine(max_total_tokens=8192, chunked_prefill_size=16) as e:
        e.scheduler.overlap = True
        limits = [1, 48, 7, 1, 30, 48, 12, 2][: len(prompts_ids)]
        params = [{**PARAMS, "max_new_tokens": m} for m in limits]
        outs = e.generate(input_ids=prompts_ids, sampling_params=params)
        for out, ref, m in zip(outs, reference, limits, strict=True):
            assert out["output_ids"] == ref[:m]
        st = e.scheduler.stats
        assert st.num_overlapped_prefill_batches >= 5
        lp = e.generate(
            input_ids=prompts_ids[:3],
            sampling_params=params[:3],
            return_logprob=True,
            logprob_start_len=0,
        )
        assert [o["output_ids"] for o in lp] == [reference[0][:1], reference[1], reference[2][:7]]
        for o, ids in zip(lp, prompts_ids, strict=False):
            assert len(o["meta_info"]["input_token_logprobs"]) == len(ids)
        # prompts only scored (no new token) amid generating ones, in 16-token chunks
        scored = e.generate(
            input_ids=prompts_ids[:4],
            sampling_params=[{**PARAMS, "max_new_tokens": m} for m in (0, 9, 0, 3)],
            return_logprob=True,
            logprob_start_len=0,
        )
        assert [o["output_ids"] for o in scored] == [[], reference[1][:9], [], reference[3][:3]]
        for o, ids, first in zip(scored, prompts_ids, lp + [None], strict=False):
            got = o["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in got] == ids
            if first is not None:  # (the same prompt's logprobs, in another batch)
                want = first["meta_info"]["input_token_logprobs"]
                assert [v for v, _, _ in got[1:]] == pytest.approx(
                    [v for v, _, _ in want[1:]], abs=1e-4
                )
        _assert_balanced(e)


def test_overlap_chains_while_waiting_requests_cannot_be_admitted(
    prompts_ids, reference, monkeypatch
):
    """With the KV pool holding two requests' reservations at a time, the others wait; while
    none of them could be admitted, decode steps still chain on the one in flight (resolving it
    first would admit nothing). Outputs equal the one-at-a-time reference, every request is
    admitted once room frees, and the pages balance."""
    from loom.scheduler.prefill import PrefillManager

    blocked = []
    real = PrefillManager.nothing_admissible

    def counted(self):
        out = real(self)
        blocked.append(out)
        return out

    monkeypatch.setattr(PrefillManager, "nothing_admissible", counted)
    longest = max(len(i) for i in prompts_ids) + PARAMS["max_new_tokens"]
    with loom.Engine(max_total_tokens=2 * longest + 16) as e:
        e.scheduler.overlap = True
        outs = e.generate(input_ids=prompts_ids, sampling_params=PARAMS)
        assert [o["output_ids"] for o in outs] == reference
        st = e.scheduler.stats
        assert st.num_prefill_batches >= 3 and st.num_retractions == 0  # they did wait
        _assert_balanced(e)
    assert any(blocked) and not all(blocked)  # chained while blocked, admitted when not
    assert st.num_overlapped_batches > st.num_decode_batches // 2


def test_admits_every_request_whose_peak_fits_and_never_retracts(prompts_ids, monkeypatch):
    """Requests of different output lengths, every one running to its limit, with a pool
    smaller than their expected pages (SGLang's 0.7 x max_new_tokens each) but no smaller than
    their bounded peak: none is ever left waiting by a prefill step, none is retracted, the
    greedy outputs equal those generated one at a time, and the pages balance."""
    from loom.scheduler.admission import peak_pages
    from loom.scheduler.prefill import PrefillManager

    left = []  # requests still waiting after each admission
    real = PrefillManager.schedule

    def schedule(self):
        items = real(self)
        left.append(len(self.waiting))
        return items

    limits = [4 + 12 * i for i in range(len(prompts_ids))]
    params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for m in limits]
    lens = [len(p) for p in prompts_ids]
    # + 1: a request finishing by length decodes one step past its last token when steps chain
    pool = peak_pages(lens, [m + 1 for m in limits], [0] * len(lens), 1) + 2
    expected = sum(n + -(-7 * m // 10) for n, m in zip(lens, limits, strict=True))
    assert expected > pool + 40  # the expected pages alone would not admit them all
    with loom.Engine(max_total_tokens=pool, page_size=1, max_running_requests=16) as e:
        ref = [
            e.generate(input_ids=p, sampling_params=s)["output_ids"]
            for p, s in zip(prompts_ids, params, strict=True)
        ]
        e.flush_cache()  # no cached prompt may shrink what admitting them takes
        retractions = e.scheduler.stats.num_retractions
        monkeypatch.setattr(PrefillManager, "schedule", schedule)
        outs = e.generate(input_ids=prompts_ids, sampling_params=params)
        assert [o["output_ids"] for o in outs] == ref
        assert [len(o["output_ids"]) for o in outs] == limits
        assert left and not any(left)
        assert e.scheduler.stats.num_retractions == retractions
        _assert_balanced(e)


def test_startup_warmup_leaves_a_clean_engine(prompts_ids, reference, monkeypatch):
    """The GPU's start-up warm-up (forced here on CPU): throwaway requests through each
    sampling path (argmax, temperature with and without top-p, penalties with logit bias,
    min_new_tokens, a seeded row) and prompts of 16, 21, 1 and 69 tokens, all finishing; then the
    engine starts clean (no cached prefix, every page free, counters at zero) and its first
    request gives the reference output."""
    import loom.engine.backends as backends
    from loom.engine.warmup import ROUNDS
    from loom.scheduler.scheduler import Scheduler

    rids = []
    real_add = Scheduler.add_request

    def add(self, req):
        rids.append(req.rid)
        return real_add(self, req)

    monkeypatch.setattr(backends, "_wants_warmup", lambda runner, args: True)
    monkeypatch.setattr(Scheduler, "add_request", add)
    with loom.Engine(max_total_tokens=4096) as e:
        assert len(rids) == 2 * (3 + len(ROUNDS))
        assert all(r.startswith("loom-warmup-") for r in rids)
        sched = e.scheduler
        assert sched.stats.num_prefill_batches == 0 and sched.stats.num_generated_tokens == 0
        assert sched.cache.tree.total_size == 0
        assert sched.cache.allocator.num_free == sched.cache.allocator.num_pages
        out = e.generate(input_ids=prompts_ids[0], sampling_params=PARAMS)
        assert out["output_ids"] == reference[0]
        assert out["meta_info"]["cached_tokens"] == 0


def test_step_profile_accounts_for_every_step(engine, prompts_ids):
    """`bench offline`'s step profile: the counters' differences over one run add up."""
    from loom.bench.offline import step_profile

    before = dict(engine.get_server_info())
    outs = engine.generate(
        input_ids=prompts_ids[:3],
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    p = step_profile(before, engine.get_server_info())
    # every output token but each request's first (sampled by its prefill) is a decode token
    assert p["num_decode_tokens"] == sum(len(o["output_ids"]) - 1 for o in outs)
    assert p["num_prefill_batches"] >= 1 and p["num_decode_batches"] >= 5
    assert p["time_prefill_s"] > 0 and p["time_decode_s"] > 0
    assert p["mean_decode_batch"] == p["num_decode_tokens"] / p["num_decode_batches"]
    # the decode steps' host phases are each timed and lie within the decode steps' time
    phases = [p[k] for k in ("time_forward_launch_s", "time_sampling_launch_s", "time_resolve_s")]
    assert all(x > 0 for x in phases)
    assert sum(phases) + p["time_device_wait_s"] <= p["time_decode_s"]


def test_step_profile_counts_the_wait_for_the_inflight_decode_as_decode():
    """A step that first waits for the overlapped decode step still in flight, then prefills:
    the wait goes to decode time, the rest to prefill time."""
    from loom.scheduler.scheduler import Scheduler
    from loom.scheduler.stats import SchedulerStats

    sched = object.__new__(Scheduler)
    sched.stats = SchedulerStats()
    sched._failed, sched._live = [], {}

    def fake_step():
        sched._tail_s = 0.03  # resolved the in-flight decode step
        sched.stats.num_prefill_batches += 1
        time.sleep(0.05)
        return []

    sched._step = fake_step
    sched.step()
    assert sched.stats.time_decode_s == 0.03
    assert 0.015 < sched.stats.time_prefill_s < 0.5


@pytest.mark.parametrize("chunk", [16, 64])
def test_overlap_chains_mixed_steps_on_the_step_in_flight(prompts_ids, reference, chunk):
    """--enable-mixed-chunk under overlap (forced on CPU, where the device is synchronous but
    the code path is the same): prefill chunks that also decode the running requests launch on
    the samples of the step in flight and go in flight themselves; greedy outputs equal
    one-at-a-time generation, requests finishing at three different steps, and the pool
    balances."""
    with loom.Engine(
        max_total_tokens=8192, enable_mixed_chunk=True, chunked_prefill_size=chunk
    ) as e:
        st = _overlapped_run_matches_reference(e, prompts_ids, reference)
        assert st.num_mixed_batches > 0 and st.num_chained_mixed_batches > 0
        assert st.num_overlapped_batches > 10
        _assert_balanced(e)
