"""``--quantization bitsandbytes`` on CUDA: a checkpoint transformers quantized on the GPU, read by
Loom on the GPU, against transformers' own bitsandbytes model (the same bytes, the same
kernels), and NF4 decoding inside the CUDA graphs against the eager run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from loom.config import ServerArgs  # noqa: E402
from tests.conftest import save_tiny_llama  # noqa: E402
from tests.gpu.test_cuda_quantization import graphs_match_eager  # noqa: E402

pytestmark = pytest.mark.gpu

BNB = {
    "nf4": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    ),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def tiny_dense(tmp_path_factory) -> str:
    return save_tiny_llama(
        tmp_path_factory.mktemp("bnb-cuda") / "dense",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
    )


@pytest.mark.parametrize("case", list(BNB))
def test_transformers_cuda_checkpoint_matches_transformers_on_cuda(case, tiny_dense, tmp_path):
    """transformers quantizes the tiny Llama on the GPU and saves it; Loom reads it on the GPU
    (its quantization_config selects bitsandbytes). The packed projections give what
    transformers' bitsandbytes modules give on the same bf16 input; the logits stay within
    what bf16 rounding between two implementations of the same model moves (4% of their
    scale: the bf16 dense models differ by up to 2%, measured on CPU), with the same argmax."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.test_llama_parity import _loom_logits, bound_runner

    hf = AutoModelForCausalLM.from_pretrained(
        tiny_dense,
        quantization_config=BitsAndBytesConfig(**BNB[case]),
        device_map="cuda",
        dtype=torch.bfloat16,
    ).eval()
    hf.save_pretrained(tmp_path / "bnb")
    bound = bound_runner(
        ServerArgs(
            model=str(tmp_path / "bnb"), device="cuda", dtype="bfloat16", max_total_tokens=1024
        )
    )
    runner = bound[0]
    assert runner.model_config.quant_config.name == "bitsandbytes"
    attn, hf_attn = runner.model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert attn.qkv_proj.weight is None and attn.qkv_proj.quant_method.prequantized
    x = torch.randn(5, 128, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        want = torch.cat([hf_attn.q_proj(x), hf_attn.k_proj(x), hf_attn.v_proj(x)], dim=-1)
        got = attn.qkv_proj(x)
        tol = 0.0 if case == "nf4" else 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
    for split in (None, len(ids) - 1):
        out = _loom_logits(bound, ids, split).float()
        err, scale = (out - ref).abs().max().item(), ref.abs().max().item()
        assert err <= 0.04 * scale and out.argmax() == ref.argmax(), (split, err, scale)


def test_nf4_at_load_runs_inside_the_graphs(tiny_dense):
    """A dense checkpoint quantized to NF4 at load, bf16 on the GPU: greedy tokens with CUDA
    graphs equal the eager run's (up to near-ties), and the pool balances."""
    graphs_match_eager(tiny_dense, "bitsandbytes")
