"""GGUF files of every family Loom serves, written as llama.cpp's converter writes them (tiny
random HF models at F32, by ``loom.testing.gguf_writer``): the loader's config and weights
against the source model's own, Loom's forward against the source model, and against
transformers loading the same file (the oracle) where transformers reads that family.

The Qwen families get a tiny byte-level BPE vocabulary, the others a tiny SentencePiece one (as
their real files have); both go through transformers' GGUF tokenizer conversion."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf")

from loom.config import ServerArgs  # noqa: E402
from loom.model_loader.gguf_layouts import LAYOUTS, Metadata, layout_for  # noqa: E402
from loom.model_loader.gguf_loader import GGUFLoader, gguf_to_hf_name  # noqa: E402
from loom.testing import check_model_loader, tiny_config  # noqa: E402
from loom.testing.gguf_writer import Vocab, bpe_vocab, spm_vocab, write_gguf  # noqa: E402
from tests.test_llama_parity import _loom_logits, bound_runner  # noqa: E402

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 16.0,
    "original_max_position_embeddings": 1024,
}
_PHI3_LONGROPE = {  # the rotary half of a head of 16: four frequencies
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "long_factor": [1.0, 1.5, 3.0, 6.0],
    "short_factor": [1.0, 1.0, 1.25, 1.5],
    "original_max_position_embeddings": 64,
}
_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
# case -> (GGUF architecture, the source model's HF architecture, its config beyond
# loom.testing's tiny one, vocabulary). Sliding windows (8) and soft-caps bind on the prompts.
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("llama", "LlamaForCausalLM", {}, "spm"),
    # Llama 3's rope scaling, with two frequencies between the unscaled and the scaled ones
    "llama3": ("llama", "LlamaForCausalLM", {"rope_parameters": _LLAMA3_ROPE}, "spm"),
    # llama.cpp writes Mistral as llama, without its sliding window: it loads as Llama
    "mistral": ("llama", "MistralForCausalLM", {"sliding_window": None}, "spm"),
    # and Mixtral as llama with experts
    "mixtral": ("llama", "MixtralForCausalLM", {}, "spm"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {"use_sliding_window": False}, "bpe"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {}, "bpe"),
    # llama.cpp's qwen2moe has every layer sparse
    "qwen2moe": ("qwen2moe", "Qwen2MoeForCausalLM", {"mlp_only_layers": []}, "bpe"),
    "qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM", {}, "bpe"),
    # llama.cpp scales queries by 1/sqrt(head_dim) (but in the 27B)
    "gemma2": ("gemma2", "Gemma2ForCausalLM", {"query_pre_attn_scalar": 16}, "spm"),
    # six layers: llama.cpp's pattern, five sliding then one global (whose rope is scaled)
    "gemma3": (
        "gemma3",
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "num_hidden_layers": 6,
            "layer_types": None,
            "rope_parameters": _GEMMA3_ROPE,
        },
        "spm",
    ),
    "phi3": ("phi3", "Phi3ForCausalLM", {"sliding_window": 8}, "spm"),
    # Phi-3's long-context rope: per-frequency factors as tensors
    "phi3-longrope": (
        "phi3",
        "Phi3ForCausalLM",
        {"original_max_position_embeddings": 64, "rope_parameters": _PHI3_LONGROPE},
        "spm",
    ),
}
# Config fields transformers' GGUF reader leaves at its config class's defaults (metadata it does
# not read, or reads under a wrong name): the oracle takes them from the source config.
ORACLE_CONFIG: dict[str, tuple[str, ...]] = {
    "llama3": ("rope_parameters",),  # rope_freqs is not read
    "qwen3": ("head_dim",),  # attention.key_length is not read for qwen3
    "qwen2moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "qwen3moe": ("moe_intermediate_size",),
    # the soft-caps are not read; the query scale is not in a file
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
    # the global layers' rope scaling is not read
    "gemma3": ("query_pre_attn_scalar", "rope_parameters"),
    # rope.dimension_count (partial rotary) and the window are not read; the default padding id
    # (32000) lies outside a tiny vocabulary
    "phi3": ("rope_parameters", "sliding_window", "pad_token_id"),
    "phi3-longrope": ("rope_parameters", "original_max_position_embeddings", "pad_token_id"),
}
NO_ORACLE = {"mixtral": "transformers reads a llama file without its experts"}

_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "sliding_window",
    "layer_types",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


@dataclass
class Case:
    name: str
    path: str
    source: torch.nn.Module  # the HF model the file was written from


@pytest.fixture(autouse=True)
def _no_gguf_cache(monkeypatch):
    monkeypatch.setenv("LOOM_GGUF_CACHE", "0")


def _random_norms(model: torch.nn.Module, offset: float) -> None:
    """Norm weights apart from each other (HF builds them equal), in steps of 2^-10 so that
    the converter's +1 for Gemma and the loader's -1 are exact in fp32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(offset + torch.randint(-256, 257, p.shape) / 1024)


def _build(name: str, directory: str) -> Case:
    from transformers import AutoModelForCausalLM

    arch, hf_arch, extra, kind = FAMILIES[name]
    vocab = bpe_vocab() if kind == "bpe" else spm_vocab()
    config = tiny_config(hf_arch, vocab_size=len(vocab.tokens), **extra)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config).float().eval()
    _random_norms(source, 0.0 if arch.startswith("gemma") else 1.0)
    path = os.path.join(directory, f"tiny-{name}.gguf")
    write_gguf(path, arch, source, vocab)
    return Case(name, path, source)


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory) -> Case:
    return _build(request.param, str(tmp_path_factory.mktemp(request.param)))


def _assert_same(got: Any, want: Any, what: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: {got!r} != {want!r}"
        for k in want:
            _assert_same(got[k], want[k], f"{what}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{what}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{what}[{i}]")
    elif isinstance(want, float):  # the file holds float32
        assert got is not None and math.isclose(got, want, rel_tol=1e-6), f"{what}: {got} != {want}"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def test_config_from_metadata(case):
    config = GGUFLoader().load_hf_config(case.path)
    source = case.source.config
    want_arch = "LlamaForCausalLM" if case.name == "mistral" else source.architectures[0]
    assert config.architectures == [want_arch]
    for field in _CONFIG_FIELDS:
        want = getattr(source, field, None)
        if want is not None or field == "sliding_window":
            _assert_same(getattr(config, field, None), want, f"{case.name}: {field}")


def _checkpoint(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s HF checkpoint: experts under per-expert names, a tied head left out."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        prefix = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, w in enumerate(t):
                out[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


def test_weights_equal_the_source_checkpoint(case):
    loader = GGUFLoader()
    got = dict(loader.iterate_weights(case.path, loader.load_hf_config(case.path)))
    want = _checkpoint(case.source)
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{case.name}: {name}"


def test_loom_serves_the_file_as_the_source_model(case):
    # config, tokenizer, a fully written model; extend, cached-prefix and decode forwards
    check_model_loader("gguf", case.path, reference=case.source, dtypes=(torch.float32,))
    tok = GGUFLoader().load_tokenizer(case.path)
    for text in ("hello world", "the loom weaves tokens", "héllo!"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _transformers_model(case: Case) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    d, f = os.path.split(case.path)
    config = AutoConfig.from_pretrained(d, gguf_file=f)
    for field in ORACLE_CONFIG.get(case.name, ()):
        setattr(config, field, getattr(case.source.config, field))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, config=config, dtype=torch.float32)
    return model.eval()


def test_logits_match_transformers_reading_the_file(case):
    if case.name in NO_ORACLE:
        pytest.skip(NO_ORACLE[case.name])
    oracle = _transformers_model(case)
    bound = bound_runner(ServerArgs(model=case.path, load_format="gguf", max_total_tokens=256))
    rng = random.Random(0)
    for n in (5, 19, 33):  # shorter and longer than the sliding windows
        ids = [rng.randrange(oracle.config.vocab_size) for _ in range(n)]
        with torch.inference_mode():
            want = oracle(torch.tensor([ids])).logits[0, -1]
        got = _loom_logits(bound, ids)
        assert (got - want).abs().max().item() < 1e-3, f"{case.name}: prompt of {n}"


@pytest.mark.parametrize(
    "arch, leaf, hf",  # a tensor of layer 2: GGUF leaf -> HF name under model.layers.2
    [
        ("llama", "ffn_norm.weight", "post_attention_layernorm.weight"),
        ("gemma2", "ffn_norm.weight", "pre_feedforward_layernorm.weight"),
        ("gemma2", "post_attention_norm.weight", "post_attention_layernorm.weight"),
        ("gemma3", "post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        ("gemma3", "attn_k_norm.weight", "self_attn.k_norm.weight"),
        ("phi3", "attn_qkv.weight", "self_attn.qkv_proj.weight"),
        ("phi3", "ffn_up.weight", "mlp.gate_up_proj.weight"),
        ("qwen2", "attn_q.bias", "self_attn.q_proj.bias"),
        ("qwen2moe", "ffn_gate_inp.weight", "mlp.gate.weight"),
        ("qwen2moe", "ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
        ("qwen3moe", "ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
    ],
)
def test_tensor_names(arch, leaf, hf):
    assert gguf_to_hf_name(f"blk.2.{leaf}", arch) == f"model.layers.2.{hf}"


def test_global_tensor_names():
    assert gguf_to_hf_name("token_embd.weight", "gemma2") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight", "qwen3") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight", "llama") is None  # not a weight


def test_shared_expert_gate_of_either_converter_age():
    layout = LAYOUTS["qwen2moe"]
    for w in (torch.ones(64).numpy(), torch.ones(1, 64).numpy()):  # squeezed, or not
        [(name, out)] = layout.hf_tensors("blk.0.ffn_gate_inp_shexp.weight", w, None)
        assert name == "model.layers.0.mlp.shared_expert_gate.weight" and out.shape == (1, 64)


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="'falcon' is not supported; supported: llama, qwen2"):
        layout_for(Metadata({"general.architecture": "falcon"}, {}))


def test_tokenizer_transformers_cannot_build_names_the_family(tmp_path):
    from transformers import AutoModelForCausalLM

    bpe = bpe_vocab()
    source = AutoModelForCausalLM.from_config(
        tiny_config("Qwen2ForCausalLM", vocab_size=len(bpe.tokens))
    )
    path = str(tmp_path / "odd-tokenizer.gguf")
    write_gguf(path, "qwen2", source, Vocab("rwkv", bpe.tokens, bpe.types))
    loader = GGUFLoader()
    assert loader.load_hf_config(path).architectures == ["Qwen2ForCausalLM"]  # still loads
    with pytest.raises(ValueError, match="architecture 'qwen2', tokenizer.ggml.model 'rwkv'"):
        loader.load_tokenizer(path)


def test_cache_gives_the_same_config_tokenizer_and_weights(tmp_path, monkeypatch):
    case = _build("qwen2moe", str(tmp_path))  # experts: weights that are slices of one tensor
    monkeypatch.setenv("LOOM_GGUF_CACHE", "1")
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    first, second = GGUFLoader(), GGUFLoader()
    config = first.load_hf_config(case.path)
    weights = dict(first.iterate_weights(case.path, config))
    tok = first.load_tokenizer(case.path)
    [entry] = os.listdir(tmp_path / "cache" / "gguf-v2")
    assert sorted(os.listdir(tmp_path / "cache" / "gguf-v2" / entry)) == [
        "config",
        "tokenizer",
        "weights",
    ]
    again = second.load_hf_config(case.path)
    assert again.to_diff_dict() | {"_name_or_path": ""} == config.to_diff_dict() | {
        "_name_or_path": ""
    }
    cached = dict(second.iterate_weights(case.path, config))
    assert sorted(cached) == sorted(weights)
    assert all(torch.equal(cached[n], w) for n, w in weights.items())
    assert second.load_tokenizer(case.path).encode("hello world") == tok.encode("hello world")
