"""Quantization on CUDA: fp8's FP8 matmuls (``torch._scaled_mm``, per-token activation scales)
against the dense layers, and inside the CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import loom
from loom.testing import check_quantization
from tests.conftest import save_tiny_llama
from tests.gpu.test_cuda_engine import _assert_greedy_equal_up_to_near_ties

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(
        tmp_path_factory.mktemp("fp8"), vocab_size=512, hidden_size=128, intermediate_size=256
    )


def test_fp8_layers_match_the_dense_ones_in_bf16(tiny_dir):
    assert (
        check_quantization("fp8", tiny_dir, rtol=0.1, min_layers=4, device="cuda", dtype="bfloat16")
        >= 4
    )


def graphs_match_eager(model: str, quantization: str, check=None) -> None:
    """bf16 on the GPU with ``quantization``: greedy tokens with CUDA graphs equal the eager
    run's (up to near-ties) and the pool balances; ``check(engine)`` runs on the graphed one."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    kw = dict(
        model=model,
        device="cuda",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_total_tokens=8192,
        quantization=quantization,
    )
    with loom.Engine(disable_cuda_graph=True, **kw) as e:
        want = e.generate(input_ids=prompts, sampling_params=params, **lp)
    with loom.Engine(**kw) as e:
        assert e.runner.cuda_graph_runner is not None
        if check is not None:
            check(e)
        got = e.generate(input_ids=prompts, sampling_params=params, **lp)
        e.scheduler.check_kv_balance()
    _assert_greedy_equal_up_to_near_ties(got, want, tol=0.05)


def test_fp8_runs_its_fp8_matmul_inside_the_graphs(tiny_dir):
    """bf16 with --quantization fp8: the layers take the FP8 matmul (Hopper), and greedy tokens
    with CUDA graphs equal the eager run's (up to near-ties); the pool balances."""

    def fp8_matmuls(e):
        layers = [m for m in e.runner.model.modules() if getattr(m, "quant_method", None)]
        assert layers and all(m.fp8_matmul for m in layers)

    graphs_match_eager(tiny_dir, "fp8", fp8_matmuls)


# Each projection in a block format the CUDA path keeps (the K-quants, which gguf-py cannot
# write, are covered at the kernel level by tests/test_gguf_triton.py).
GGUF_TYPES = {
    "attn_q.weight": "Q4_0",
    "attn_k.weight": "Q4_0",
    "attn_v.weight": "Q4_0",
    "attn_output.weight": "Q8_0",
    "ffn_gate.weight": "Q5_0",
    "ffn_up.weight": "Q5_0",
    "ffn_down.weight": "Q4_1",
}


@pytest.fixture(scope="module")
def gguf_blocks_file(tmp_path_factory):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from loom.testing.gguf_writer import bpe_vocab, write_gguf
    from loom.testing.model import tiny_config

    vocab = bpe_vocab()
    config = tiny_config("LlamaForCausalLM", vocab_size=len(vocab.tokens), hidden_size=128,
                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    path = str(tmp_path_factory.mktemp("gguf-blocks") / "tiny.gguf")
    write_gguf(path, "llama", model, vocab, quant=GGUF_TYPES)
    return path


def test_gguf_blocks_layers_match_the_dequantized_file(gguf_blocks_file):
    """On CUDA every projection keeps its file's blocks (uint8 on the device) and its Triton
    matmul gives what the dense layer of the same file, dequantized at load, gives: fp32 within
    summation order (1e-3 of the output's scale)."""
    from loom.layers.quantization.gguf import GGUFBlocksLinearMethod

    n = check_quantization(
        "gguf", gguf_blocks_file, rtol=1e-3, min_layers=4, device="cuda", dtype="float32"
    )
    assert n >= 4
    with loom.Engine(
        model=gguf_blocks_file, device="cuda", quantization="gguf", max_total_tokens=1024,
        disable_cuda_graph=True, skip_tokenizer_init=True,
    ) as e:  # fmt: skip
        layers = [m for m in e.runner.model.modules() if getattr(m, "quant_method", None)]
        assert all(isinstance(m.quant_method, GGUFBlocksLinearMethod) for m in layers)
        assert {m.quant_method.qtype for m in layers} == {"Q4_0", "Q8_0", "Q5_0", "Q4_1"}
        assert all(m.weight.dtype == torch.uint8 for m in layers)


def test_gguf_blocks_in_the_graphs_give_the_dense_files_tokens(gguf_blocks_file):
    """bf16, CUDA graphs on: greedy tokens of the blocks kept on the device equal those of the
    same file dequantized at load (up to near-ties); the pool balances."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    kw = dict(model=gguf_blocks_file, device="cuda", dtype="bfloat16", max_total_tokens=8192,
              skip_tokenizer_init=True)  # fmt: skip
    with loom.Engine(**kw) as e:
        want = e.generate(input_ids=prompts, sampling_params=params, **lp)
    with loom.Engine(quantization="gguf", **kw) as e:
        assert e.runner.cuda_graph_runner is not None
        got = e.generate(input_ids=prompts, sampling_params=params, **lp)
        e.scheduler.check_kv_balance()
    _assert_greedy_equal_up_to_near_ties(got, want, tol=0.05)
