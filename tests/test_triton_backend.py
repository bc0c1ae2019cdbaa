"""The Triton backends end to end (on CPU under TRITON_INTERPRET=1, on CUDA for real): greedy
tokens equal torch_native's on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

import loom

pytest.importorskip("triton")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)  # wide logits: no near-ties for greedy to flip on


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-triton")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(path)
    return str(path)


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
