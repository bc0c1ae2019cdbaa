"""The GGUF loader on a file written here: a tiny random Llama in llama.cpp's layout (q/k rows
permuted) with one tensor type per matrix, against HF running the same dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.config import ServerArgs
from loom.model_executor.model_runner import ModelRunner
from tests.test_llama_parity import _loom_logits, bound_runner

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

HEADS, KV_HEADS, HIDDEN, INTER, LAYERS, VOCAB = 4, 2, 64, 128, 2, 256
TYPES = {  # HF projection -> GGUF type: every type Loom promises besides the K-quants
    "q_proj": Q.Q8_0,
    "k_proj": Q.Q4_0,
    "v_proj": Q.Q4_1,
    "o_proj": Q.Q5_0,
    "gate_proj": Q.Q5_1,
    "up_proj": Q.F16,
    "down_proj": Q.BF16,
}
GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # what llama.cpp's convert_hf_to_gguf.py does to q/k rows
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    state = {}
    sd = hf.state_dict()

    def put(gguf_name: str, hf_name: str, qtype: Q, permute_heads: int | None = None):
        x = sd[hf_name].float().numpy()
        data = quantize(x, qtype)
        state[hf_name] = torch.from_numpy(dequantize(data, qtype).astype(np.float32).copy())
        if permute_heads:  # quantisation is per row, so permuting rows commutes with it
            data = _llama_cpp_permute(data, permute_heads)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)

    put("token_embd.weight", "model.embed_tokens.weight", Q.F16)
    put("output_norm.weight", "model.norm.weight", Q.F32)
    put("output.weight", "lm_head.weight", Q.Q8_0)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        put(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", Q.F32)
        put(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", Q.F32)
        for proj, qtype in TYPES.items():
            sub = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(proj)
            put(f"blk.{i}.{GGUF_NAMES[proj]}.weight", f"{p}{sub}.{proj}.weight", qtype, heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict(state)  # the oracle runs exactly the dequantised weights
    return str(path), hf


def test_tiny_gguf_matches_hf_on_dequantised_weights(tiny_gguf, monkeypatch):
    monkeypatch.setenv("LOOM_GGUF_CACHE", "0")
    path, hf = tiny_gguf
    runner, cache = bound_runner(ServerArgs(model=path, load_format="gguf", max_total_tokens=512))
    cfg = runner.model_config.hf_config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (
        HEADS,
        KV_HEADS,
        False,
    )
    ids = torch.randint(0, VOCAB, (40,)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = _loom_logits((runner, cache), ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_auto_load_format_picks_gguf(tiny_gguf, monkeypatch):
    monkeypatch.setenv("LOOM_GGUF_CACHE", "0")
    runner = ModelRunner(ServerArgs(model=tiny_gguf[0], max_total_tokens=512))
    assert type(runner.loader._pick(tiny_gguf[0])).__name__ == "GGUFLoader"
