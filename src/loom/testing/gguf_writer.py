"""A GGUF file of an HF model, written the way llama.cpp's converter (``convert_hf_to_gguf.py``)
writes its architecture, with a tiny vocabulary: for testing a GGUF loader against the HF model
(or against transformers' own GGUF loading) without a model hub.

F32 tensors named by gguf-py's table (``gguf.TensorNameMap``, which the converter names with),
with the converter's changes to values: llama's q/k rows permuted, Gemma's norms stored as
``w + 1``, experts stacked per projection. The metadata keys are the ones each family's converter
class writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
_WORDS = ("hello", "world", "the", "loom", "weaves", "tokens")


@dataclass
class Vocab:
    """A GGUF tokenizer section: ``model`` "gpt2" (byte-level BPE) or "llama" (SentencePiece)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special: dict[str, int] = field(default_factory=dict)  # bos / eos / unk / pad -> id


def bpe_vocab() -> Vocab:
    """Byte-level BPE (as Qwen's): the 256 byte symbols, merges spelling a few words with and
    without a leading space, and ChatML's special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = []
    for word in _WORDS:
        for text in (word, " " + word):
            pieces = ["".join(bytes_to_unicode()[b] for b in ch.encode()) for ch in text]
            while len(pieces) > 1:
                merges.append(f"{pieces[0]} {pieces[1]}")
                pieces[:2] = [pieces[0] + pieces[1]]
                if pieces[0] not in tokens:
                    tokens.append(pieces[0])
    merges = list(dict.fromkeys(merges))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(specials)
    first = len(tokens)
    return Vocab(
        "gpt2", tokens + specials, types, merges=merges, special={"eos": first + 2, "pad": first}
    )


def spm_vocab() -> Vocab:
    """SentencePiece with byte fallback (as Llama's, Gemma's, Phi-3's): <unk> <s> </s>, the 256
    byte tokens, then word pieces scored best-first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    pieces: list[str] = ["\u2581"]
    for word in _WORDS:
        for text in (word, "\u2581" + word):
            pieces += [text[: i + 1] for i in range(len(text))]
    pieces = list(dict.fromkeys(pieces))
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return Vocab(
        "llama",
        tokens + pieces,
        types + [NORMAL] * len(pieces),
        scores=scores,
        special={"unk": 0, "bos": 1, "eos": 2},
    )


def _rope(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The config's rope parameters (of ``layer_type`` where they are per layer type)."""
    rope = getattr(config, "rope_parameters", None) or {}
    return rope[layer_type] if isinstance(rope.get(layer_type), dict) else rope


def _write_metadata(w: Any, arch: str, config: Any) -> None:
    """The hyperparameters each family's converter class writes."""
    import gguf

    c = config
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = _rope(c)
    if arch != "gemma2":  # Gemma 2's converter writes no rope base (llama.cpp: 10,000)
        w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch != "phi3":  # the others write HF's head_dim (Phi-3's converter: a rope width)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(_rope(c, "sliding_attention")["rope_theta"])
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)


def _write_vocab(w: Any, vocab: Vocab) -> None:
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre("qwen2" if vocab.model == "gpt2" else "default")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores:
        w.add_token_scores(vocab.scores)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special.items():
        getattr(w, f"add_{kind}_token_id")(token_id)


def gguf_tensors(arch: str, model: nn.Module) -> dict[str, np.ndarray]:
    """``model``'s weights as llama.cpp's converter writes them for ``arch`` (GGUF name ->
    F32 array)."""
    import gguf

    config = model.config
    table = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}

    def put(hf_name: str, w: np.ndarray) -> None:
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"{arch}: gguf-py has no name for {hf_name}"
        out[name] = np.ascontiguousarray(w, dtype=np.float32)

    for hf_name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # not in the checkpoint
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up
            gate, up = np.split(w, 2, axis=1)
            put(hf_name.replace("gate_up_proj", "gate_proj.weight"), gate)
            put(hf_name.replace("gate_up_proj", "up_proj.weight"), up)
            continue
        if hf_name.endswith("mlp.experts.down_proj"):
            hf_name += ".weight"
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = (
                config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            )
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            w = w.reshape(t.shape)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1
        if hf_name.endswith("shared_expert_gate.weight"):
            # [1, hidden] squeezed, as converters did for long (and transformers' GGUF reader
            # expects); today's converter keeps [1, hidden]; Loom reads either
            w = w.reshape(-1)
        put(hf_name, w)
    return out


def _llama3_rope_divisors(config: Any) -> np.ndarray:
    """Llama 3's rope scaling as the converter writes it: one divisor per frequency."""
    rope = _rope(config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    wavelength = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    original, low, high = (
        rope["original_max_position_embeddings"],
        rope["low_freq_factor"],
        rope["high_freq_factor"],
    )
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 / ((1 - smooth) / rope["factor"] + smooth)).astype(np.float32)


def write_gguf(
    path: str, arch: str, model: nn.Module, vocab: Vocab, quant: dict[str, str] | None = None
) -> None:
    """Write ``model`` (an HF model whose vocabulary is ``vocab``'s) to ``path`` as llama.cpp's
    converter writes GGUF architecture ``arch`` at F32; ``quant`` maps a tensor-name suffix
    (``attn_q.weight``) to the GGML type its 2-D tensors are quantized to with gguf-py's own
    quantizer (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
    import gguf

    assert model.config.vocab_size == len(vocab.tokens), "the model's vocabulary is the vocab's"
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    _write_metadata(w, arch, model.config)
    _write_vocab(w, vocab)
    for name, data in gguf_tensors(arch, model).items():
        qtype = next((t for sfx, t in (quant or {}).items() if name.endswith(sfx)), None)
        if qtype is not None and data.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)
    rope = _rope(model.config)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_divisors(model.config))
    if rope.get("rope_type") == "longrope":  # Phi-3's long-context factors
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.float32(rope[f"{kind}_factor"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
