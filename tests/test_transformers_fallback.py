"""The transformers fallback (models/transformers_fallback.py) and ``--model-impl``: architectures
with no Loom model file run through transformers' modeling code with Loom's paged attention,
against HF's own forward and greedy ``generate``.

The architectures, none with a Loom file, each plugging positions in differently: GPT-NeoX
(rotary on a quarter of each head, fused QKV, parallel residual, an untied head that its
checkpoints call ``embed_out``), GPT-2 (learned absolute positions read from ``position_ids``,
Conv1D projections, a tied head) and Starcoder2 (rotary, grouped-query attention, and a sliding
window that only the config states, shorter than the prompts)."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from loom.config import ServerArgs
from loom.model_loader.base import DeviceConfig, ModelConfig, build_model, resolve_model_class
from loom.models.llama import LlamaForCausalLM
from loom.models.transformers_fallback import TransformersForCausalLM
from loom.testing import check_model, check_model_engine, tiny_config
from loom.testing._common import TINY_LLAMA

_DECODER = {
    k: TINY_LLAMA[k] for k in ("vocab_size", "max_position_embeddings", "initializer_range")
}
ARCHITECTURES = {
    "GPTNeoXForCausalLM": (
        "gpt_neox",
        dict(
            TINY_LLAMA,
            num_key_value_heads=None,
            rotary_pct=0.25,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "GPT2LMHeadModel": (
        "gpt2",
        dict(
            _DECODER,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "Starcoder2ForCausalLM": ("starcoder2", dict(TINY_LLAMA, sliding_window=8)),
}


def _config(architecture: str):
    from transformers import AutoConfig

    model_type, kw = ARCHITECTURES[architecture]
    kw = {k: v for k, v in kw.items() if v is not None}
    return AutoConfig.for_model(model_type, architectures=[architecture], **kw)


@pytest.mark.parametrize("architecture", [*ARCHITECTURES, "LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_fallback_passes_the_model_kit(architecture):
    """Logits equal HF's over extend (with cached prefixes, with logit_indices) and decode
    batches on a paged pool; Llama and Gemma 2 (windows, attention and final soft-caps) too."""
    if architecture in ARCHITECTURES:
        config = _config(architecture)
    else:
        config = tiny_config(architecture)
    check_model(TransformersForCausalLM, hf_config=config)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_fallback_engine_greedy_equals_hf(architecture):
    """--model-impl auto takes the fallback for an architecture Loom lacks: greedy tokens equal
    HF's alone, batched, chunked and retracted."""
    check_model_engine(_config(architecture))


def test_llama_through_transformers_equals_hf(monkeypatch):
    """--model-impl transformers runs an architecture Loom implements through the fallback."""
    built = []
    init = TransformersForCausalLM.__init__

    def spy(self, config):
        built.append(config.architectures[0])
        init(self, config)

    monkeypatch.setattr(TransformersForCausalLM, "__init__", spy)
    check_model_engine(tiny_config("LlamaForCausalLM"), model_impl="transformers")
    assert built == ["LlamaForCausalLM"] * 2  # both of the kit's engines


def test_model_impl_resolution(caplog):
    with caplog.at_level(logging.INFO, logger="loom.model_loader.base"):
        assert resolve_model_class("LlamaForCausalLM") is LlamaForCausalLM
        assert resolve_model_class("LlamaForCausalLM", "loom") is LlamaForCausalLM
        assert resolve_model_class("LlamaForCausalLM", "transformers") is TransformersForCausalLM
        assert resolve_model_class("GPT2LMHeadModel") is TransformersForCausalLM
    assert caplog.messages == [
        "model: LlamaForCausalLM via Loom's implementation",
        "model: LlamaForCausalLM via Loom's implementation",
        "model: LlamaForCausalLM via transformers' modeling code (--model-impl transformers)",
        "model: GPT2LMHeadModel via transformers' modeling code (no Loom implementation)",
    ]
    with pytest.raises(ValueError, match="model_impl must be one of"):
        resolve_model_class("LlamaForCausalLM", "vllm")


def test_loom_impl_refuses_an_architecture_it_lacks():
    config = _config("GPT2LMHeadModel")
    model_config = ModelConfig("unused", config, torch.float32, 256, "GPT2LMHeadModel", 0, "loom")
    with pytest.raises(ValueError, match=r"no implementation of GPT2LMHeadModel.*LlamaForCausalLM"):
        build_model(model_config, DeviceConfig(torch.device("cpu")))


def test_model_impl_flag():
    from loom.cli import build_parser

    args = build_parser().parse_args(["serve", "--model-impl", "transformers"])
    assert ServerArgs.from_cli_args(args).model_impl == "transformers"
    assert ServerArgs().model_impl == "auto"
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ServerArgs(model_impl="vllm")


def test_hf_builds_no_mask_and_no_cache():
    """HF's attention modules get no [T, T] mask (the paged backend masks) and no KV cache."""
    from loom.testing._common import PagedForward

    config = _config("GPT2LMHeadModel")
    model = TransformersForCausalLM(config)
    seen = []
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention":
            module.register_forward_pre_hook(
                lambda m, args, kwargs: seen.append(
                    (kwargs.get("attention_mask"), kwargs.get("cache"))
                ),
                with_kwargs=True,
            )
    fwd = PagedForward(model, config, torch.device("cpu"), torch.float32)
    rows = [fwd.new_request(8), fwd.new_request(8)]
    logits = fwd.extend(rows, [0, 0], [[5, 6, 7], [8, 9]])
    assert logits.shape == (2, config.vocab_size) and logits.dtype == torch.float32
    assert len(seen) == 2 and all(mask is None and cache is None for mask, cache in seen)


def test_refuses_tensor_parallelism_and_architectures_without_the_interface(monkeypatch):
    from transformers import AutoConfig

    import loom.models.transformers_fallback as fallback

    stablelm = AutoConfig.for_model("stablelm", architectures=["StableLmForCausalLM"], **TINY_LLAMA)
    with pytest.raises(ValueError, match="does not support custom attention functions"):
        TransformersForCausalLM(stablelm)
    monkeypatch.setattr(fallback, "get_tp_size", lambda: 2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        TransformersForCausalLM(_config("GPT2LMHeadModel"))


def test_load_weights_is_strict():
    config = _config("GPTNeoXForCausalLM")
    model = TransformersForCausalLM(config)
    weights = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    weights["embed_out.weight"] = weights.pop("lm_head.weight")  # the checkpoints' name
    assert model.load_weights(weights.items()) == set(weights) - {"embed_out.weight"} | {
        "lm_head.weight"
    }
    with pytest.raises(ValueError, match="no parameters named"):
        model.load_weights([*weights.items(), ("gpt_neox.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="missing weights"):
        model.load_weights(list(weights.items())[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["GPTNeoXForCausalLM", "GPT2LMHeadModel"])
def test_fallback_under_cuda_graphs_equals_hf(architecture):
    """On a GPU the fallback's decode steps replay CUDA graphs and its extend batches run as
    piecewise graphs, and greedy tokens (fp32) still equal HF's."""
    import loom
    from loom.testing._common import save_tiny_llama
    from loom.testing.model import _hf_greedy

    config = _config(architecture)
    prompts = [[3 + (7 * i + j) % 500 for j in range(n)] for i, n in enumerate((5, 19, 40))]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as tmp:
        hf = save_tiny_llama(tmp, config)
        want = _hf_greedy(hf, prompts, 16)
        kw = dict(model=tmp, device="cuda", dtype="float32", skip_tokenizer_init=True)
        kw.update(max_total_tokens=4096, max_running_requests=8)
        with loom.Engine(**kw) as e:
            assert isinstance(e.runner.model, TransformersForCausalLM)
            assert e.runner.cuda_graph_runner is not None
            assert e.runner.piecewise_graph_runner is not None
            got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
