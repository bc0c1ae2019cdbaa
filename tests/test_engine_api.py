"""The engine's one fan-out (``engine/fan_out.py``): ``generate`` and ``async_generate`` take
batches and ``n`` alike, every request of a call reaches the scheduler in one message, and a
bad item refuses the whole call before anything is submitted."""

import asyncio

import pytest

from loom.scheduler.messages import AddRequests

PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at"]
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def _ids(engine):
    return [engine.tokenizer.encode(p) for p in PROMPTS]


def test_async_batch_equals_generate(engine):
    ids = _ids(engine)
    want = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=GREEDY)]
    got = asyncio.run(engine.async_generate(input_ids=ids, sampling_params=GREEDY))
    assert [o["output_ids"] for o in got] == want
    texts = asyncio.run(engine.async_generate(prompt=PROMPTS, sampling_params=GREEDY))
    assert [o["output_ids"] for o in texts] == want


def test_async_n_gives_generates_samples(engine):
    """n seeded samples of one prompt: sample i draws with seed + i, in the same order from
    generate and async_generate, and equals a single request seeded seed + i."""
    ids = _ids(engine)[0]
    params = {"max_new_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3}
    want = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    got = asyncio.run(engine.async_generate(input_ids=ids, sampling_params=params))
    assert [o["output_ids"] for o in got] == want
    alone = engine.generate(input_ids=ids, sampling_params={**params, "n": 1, "seed": 12})[
        "output_ids"
    ]
    assert want[1] == alone
    assert len({tuple(w) for w in want}) > 1  # the samples differ


def test_async_streams_of_a_batch_concatenate_to_the_results(engine):
    ids = _ids(engine)
    want = engine.generate(input_ids=ids, sampling_params=GREEDY)

    async def run():
        streams = await engine.async_generate(input_ids=ids, sampling_params=GREEDY, stream=True)
        assert isinstance(streams, list) and len(streams) == len(ids)
        out = []
        for s in streams:
            parts = [inc async for inc in s]
            out.append(
                ("".join(p["text"] for p in parts), sum((p["output_ids"] for p in parts), []))
            )
        return out

    got = asyncio.run(run())
    assert got == [(w["text"], w["output_ids"]) for w in want]


def test_a_bad_item_refuses_the_whole_batch_before_submitting(engine, monkeypatch):
    sent = []
    real = engine.backend.send
    monkeypatch.setattr(engine.backend, "send", lambda m: sent.append(m) or real(m))
    ids = _ids(engine)
    bad = [GREEDY, GREEDY, {"max_new_tokens": 8, "temperature": -1}]
    with pytest.raises(ValueError, match="temperature"):
        asyncio.run(engine.async_generate(input_ids=ids, sampling_params=bad))
    with pytest.raises(ValueError, match="n must be"):
        asyncio.run(engine.async_generate(input_ids=ids[0], sampling_params={"n": 65}))
    assert sent == [] and not engine.router.states


def test_a_batch_goes_to_the_scheduler_in_one_message(engine, monkeypatch):
    sent = []
    real = engine.backend.send
    monkeypatch.setattr(engine.backend, "send", lambda m: sent.append(m) or real(m))
    asyncio.run(engine.async_generate(input_ids=_ids(engine), sampling_params={**GREEDY, "n": 2}))
    adds = [m for m in sent if isinstance(m, AddRequests)]
    assert len(adds) == 1 and len(adds[0].requests) == 2 * len(PROMPTS)
