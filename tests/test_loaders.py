"""Model loaders: the same weights through safetensors; tiny random Llamas (rope scaling, untied
head, biases) against HF; dummy weights; GGUF helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import loom
from loom.config import ServerArgs
from tests.conftest import CHAT_PROMPTS, TINY_LLAMA, chat_ids, save_pt_copy, save_tiny_llama
from tests.test_llama_parity import _loom_logits, bound_runner


def test_safetensors_dir_gives_same_greedy_tokens(engine, hf_ref_dir):
    params = {"max_new_tokens": 24, "temperature": 0}
    ids = [chat_ids(engine, p) for p in CHAT_PROMPTS[:3]]
    want = [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]
    with loom.Engine(model=hf_ref_dir, load_format="safetensors", max_total_tokens=4096) as e:
        assert e.runner.model_config.architecture == "LlamaForCausalLM"
        got = [o["output_ids"] for o in e.generate(input_ids=ids, sampling_params=params)]
        assert (
            e.generate(input_ids=ids[0], sampling_params=params)["text"]
            == "The capital of France is Paris."
        )
    assert got == want


@pytest.mark.parametrize(
    "extra",
    [
        {"tie_word_embeddings": False},
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["untied", "tied-bias-linear", "llama3"],
)
def test_tiny_random_llama_matches_hf(tmp_path, extra):
    from transformers import AutoModelForCausalLM

    save_tiny_llama(tmp_path, **extra)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    runner = bound_runner(ServerArgs(model=str(tmp_path), max_total_tokens=1024))
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (150,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    for split in (None, len(ids) - 1, 100):
        got = _loom_logits(runner, ids, split)
        assert (got - ref).abs().max().item() < 1e-4, split


def test_dummy_loader_from_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({**TINY_LLAMA, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with loom.Engine(
        model=str(path), load_format="dummy", skip_tokenizer_init=True, max_total_tokens=1024
    ) as e:
        out = e.generate(
            input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
        assert len(out["output_ids"]) == 4 and out["text"] == ""
        with pytest.raises(ValueError, match="tokenizer"):
            e.generate("text needs a tokenizer")


def test_unpermute_inverts_llama_cpp_permutation():
    from loom.model_loader.gguf_loader import unpermute_rotary

    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert script: reshape(n_head, 2, rows/n_head/2, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rotary(permuted, heads), w)


def test_gguf_names():
    from loom.model_loader.gguf_loader import gguf_to_hf_name

    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_gguf_config_and_chat_template(engine):
    cfg = engine.runner.model_config.hf_config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    text = engine.tokenizer.decode(engine.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_pt_loader_reads_pickled_weights_and_refuses_code(tmp_path):
    """``*.bin`` weights load through ``torch.load(weights_only=True)`` (``auto`` picks the pt
    loader for such a directory) and give the safetensors copy's tokens; a pickle that would run
    code when loaded is refused by name."""
    import pickle

    st = save_tiny_llama(tmp_path / "st")
    save_pt_copy(st, tmp_path / "pt")
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (3, 20)).tolist()
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    kw = dict(skip_tokenizer_init=True, max_total_tokens=1024, dtype="float32")
    outs = {}
    for name in ("st", "pt"):
        with loom.Engine(model=str(tmp_path / name), **kw) as e:
            outs[name] = [
                o["output_ids"] for o in e.generate(input_ids=ids, sampling_params=params)
            ]
    assert outs["pt"] == outs["st"]

    class RunsCode:
        def __reduce__(self):
            return (print, ("this ran while unpickling",))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((tmp_path / "pt" / "config.json").read_text())
    with open(evil / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": RunsCode()}, f)
    with pytest.raises(ValueError, match="pytorch_model.bin: not a weights-only"):
        loom.Engine(model=str(evil), **kw)


def _tiny_mixtral(path) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        initializer_range=0.2,
    )
    MixtralForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model", ["tied", "untied", "mixtral"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_layered_loader_gives_the_safetensors_logits(tmp_path, model, quantization):
    """``--load-format layered`` (parameters on the meta device, given storage and loaded one
    decoder layer at a time, quantized before the next) computes exactly what the plain
    safetensors loader's model computes, over extend and decode, dense and fp8, for a dense
    Llama (tied and untied head) and a Mixtral (experts loaded by FusedMoE's own loader)."""
    if model == "mixtral":
        path = _tiny_mixtral(tmp_path / model)
    else:
        path = save_tiny_llama(tmp_path / model, tie_word_embeddings=model == "tied")
    ids = torch.randint(0, 256, (40,)).tolist()
    logits = {}
    for fmt in ("safetensors", "layered"):
        args = ServerArgs(
            model=path, load_format=fmt, quantization=quantization, max_total_tokens=1024
        )
        runner = bound_runner(args)
        assert not any(p.is_meta for p in runner[0].model.parameters())
        logits[fmt] = [_loom_logits(runner, ids, split) for split in (None, 30)]
    for got, want in zip(logits["layered"], logits["safetensors"], strict=True):
        assert torch.equal(got, want)


def test_layered_loader_refuses_transformers_modeling_code(tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")
    with pytest.raises(ValueError, match="layered needs Loom's own implementation"):
        bound_runner(
            ServerArgs(model=path, load_format="layered", model_impl="transformers",
                       max_total_tokens=1024)
        )  # fmt: skip


@pytest.fixture(scope="module")
def many_layers(tmp_path_factory) -> str:
    """A random Llama of 48 layers whose bf16 checkpoint is 390 MB: one layer is 1/48 of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=48,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("many_layers")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_layered_loader_peak_memory(many_layers, quantization):
    """Measured in a fresh process (``loom bench load``'s measurement): loading layer by layer
    adds at most 1.3x the loaded weights to the resident set. Dense, that is less than the
    plain loader, which maps the whole file; with fp8 the plain loader loads layer by layer
    too (else it would hold every dense weight before quantizing), within the same bound."""
    from loom.bench.load import measure

    kw = dict(model=many_layers, dtype="bfloat16", quantization=quantization)
    plain = measure({**kw, "load_format": "safetensors"})
    layered = measure({**kw, "load_format": "layered"})
    assert layered["weights_bytes"] == plain["weights_bytes"]
    assert layered["peak_bytes"] <= 1.3 * layered["weights_bytes"], layered
    if quantization is None:
        assert layered["peak_bytes"] < plain["peak_bytes"], (layered, plain)
    else:
        assert plain["peak_bytes"] <= 1.3 * plain["weights_bytes"], plain
