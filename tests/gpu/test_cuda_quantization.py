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


def test_fp8_runs_its_fp8_matmul_inside_the_graphs(tiny_dir):
    """bf16 with --quantization fp8: the layers take the FP8 matmul (Hopper), and greedy tokens
    with CUDA graphs equal the eager run's (up to near-ties); the pool balances."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    lp = {"return_logprob": True, "top_logprobs_num": 2}
    kw = dict(
        model=tiny_dir,
        device="cuda",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_total_tokens=8192,
        quantization="fp8",
    )
    with loom.Engine(disable_cuda_graph=True, **kw) as e:
        want = e.generate(input_ids=prompts, sampling_params=params, **lp)
    with loom.Engine(**kw) as e:
        layers = [m for m in e.runner.model.modules() if getattr(m, "quant_method", None)]
        assert layers and all(m.fp8_matmul for m in layers)
        assert e.runner.cuda_graph_runner is not None
        got = e.generate(input_ids=prompts, sampling_params=params, **lp)
        e.scheduler.check_kv_balance()
    _assert_greedy_equal_up_to_near_ties(got, want, tol=0.05)
