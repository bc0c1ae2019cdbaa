"""The Triton backends end to end (on CPU under TRITON_INTERPRET=1, on CUDA for real): greedy
tokens equal torch_native's on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

import loom
from tests.conftest import save_tiny_llama

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # wide logits (initializer_range): no near-ties for greedy to flip on
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-triton"), vocab_size=256, initializer_range=0.2
    )


@pytest.mark.parametrize("backend", ["triton", "flash_attention"])
def test_greedy_equals_torch_native(tiny_dir, backend):
    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (3, 17, 40)
    ]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    kw = dict(
        model=tiny_dir,
        skip_tokenizer_init=True,
        max_total_tokens=1024,
        dtype="float32",
        chunked_prefill_size=16,
        page_size=4,
    )
    with loom.Engine(attention_backend="torch_native", **kw) as e:
        want = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    with loom.Engine(attention_backend=backend, **kw) as e:
        assert e.get_server_info()["attention_backend"] == backend
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
