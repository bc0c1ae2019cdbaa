"""``--enable-torch-compile``: decode steps compiled with torch.compile on the CPU.

Oracle: the same engine without the flag (the eager path, itself tested against HF transformers):
greedy tokens equal over requests of different lengths decoding together, batch 1 alone, and
batches beyond --torch-compile-max-bs (eager); Dynamo compiles two graphs and no more.
"""

from __future__ import annotations

import random

import pytest

from tests.conftest import save_tiny_llama

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", seed=3)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 40))] for _ in range(n)]


def _run(model: str, **kw) -> list[list[int]]:
    import loom

    with loom.Engine(model, max_running_requests=4, skip_tokenizer_init=True, **kw) as engine:
        prompts = _prompts(6, engine.vocab_size)
        # lengths 6..16: requests finish one by one, so the running batch takes every size
        params = [{**PARAMS, "max_new_tokens": 6 + 2 * i} for i in range(len(prompts))]
        together = engine.generate(input_ids=prompts, sampling_params=params)
        alone = engine.generate(input_ids=prompts[:1], sampling_params=PARAMS)
        return [o["output_ids"] for o in together] + [alone[0]["output_ids"]]


@pytest.fixture(scope="module")
def eager(tiny) -> list[list[int]]:
    return _run(tiny)


def test_compiled_decode_equals_eager(tiny, eager):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # batches of 1..4 (six requests, four at a time): 1 through the batch-1 graph, 2 and 3
    # through the graph traced at 2, 4 beyond --torch-compile-max-bs 3, eagerly
    compiled = _run(tiny, enable_torch_compile=True, torch_compile_max_bs=3)
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 2  # batch 1, and 2; no recompiles


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ({"enable_lora": True, "max_lora_rank": 8}, "does not combine with --enable-lora"),
        ({"tp_size": 2}, "does not combine with --tp-size"),
    ],
)
def test_refused_where_it_cannot_apply(tiny, flags, error):
    import loom

    with pytest.raises(ValueError, match=error):
        loom.Engine(tiny, skip_tokenizer_init=True, enable_torch_compile=True, **flags)


def test_two_models_in_one_process_keep_their_own_graphs(tiny, eager, tmp_path):
    """The module guards are skipped (their ~1,500 checks cost a tenth of a CPU step): each
    engine's compiled step must still run its own model, never another's cached graph."""
    # the same attention shapes (so the same KV pool), another MLP: only the module guards,
    # skipped, could tell these models apart
    other = save_tiny_llama(tmp_path / "other", seed=3, hidden_act="gelu", intermediate_size=96)
    compiled = [_run(m, enable_torch_compile=True) for m in (tiny, other)]
    assert compiled == [eager, _run(other)]
    assert compiled[0] != compiled[1]
