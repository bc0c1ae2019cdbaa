"""GGUF files (llama.cpp's format): config, tokenizer and chat template from the metadata, weights
dequantised with the ``gguf`` package (F32/F16/BF16/Q8_0/Q4_0/Q4_1 and the K-quants it supports).

llama.cpp stores attn_q/attn_k rows permuted for its rotary layout; they are permuted back so the
weights equal what transformers loads from the same file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from loom import env
from loom.model_loader.base import (
    DeviceConfig,
    ModelConfig,
    ModelLoader,
    build_model,
    process_weights_after_loading,
)

logger = logging.getLogger(__name__)

# GGUF architecture -> HF architectures name. Architectures without a Loom model raise a clear
# error at model resolution (the registry lists what exists).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name (None for tensors Loom recomputes)."""
    m = _BLOCK.match(name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    base, _, kind = name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF rotate_half halves)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# Converting a GGUF's tokenizer and parsing its metadata takes seconds; both are cached on disk
# (keyed by the file's name, size and mtime). For files under this size the dequantised weights are
# cached too (as fp32 safetensors), which makes a restart take about a second.
_WEIGHT_CACHE_MAX_FILE_BYTES = 512 * 2**20


def cache_root() -> str:
    return env.cache_root()


class GGUFLoader(ModelLoader):
    def __init__(self) -> None:
        self._readers: dict[str, Any] = {}

    def _cache_dir(self, path: str) -> str | None:
        if not env.gguf_cache_enabled():
            return None
        st = os.stat(path)
        stem = os.path.basename(path).removesuffix(".gguf")
        return os.path.join(cache_root(), "gguf", f"{stem}-{st.st_size}-{int(st.st_mtime)}")

    def _cached(self, path: str, part: str) -> str | None:
        d = self._cache_dir(path)
        return d if d is not None and os.path.exists(os.path.join(d, part)) else None

    def _write_cache(self, path: str, config: Any, tokenizer: Any) -> None:
        """Write config + tokenizer (+ weights for small files) atomically; errors are harmless."""
        import shutil
        import tempfile

        d = self._cache_dir(path)
        if d is None:
            return
        os.makedirs(os.path.dirname(d), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(d), prefix=".tmp-")
        try:
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            open(os.path.join(tmp, "meta.done"), "w").close()
            if os.path.getsize(path) <= _WEIGHT_CACHE_MAX_FILE_BYTES:
                from safetensors.torch import save_file

                weights = dict(self._dequantized(path, config))
                save_file(weights, os.path.join(tmp, "model.safetensors"))
                open(os.path.join(tmp, "weights.done"), "w").close()
            try:
                os.rename(tmp, d)
            except OSError:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:
            logger.warning("could not cache GGUF conversion in %s: %s", d, e)
            shutil.rmtree(tmp, ignore_errors=True)

    def _ensure_cache(self, path: str) -> str | None:
        if self._cached(path, "meta.done") is None and self._cache_dir(path) is not None:
            self._write_cache(path, self._convert_config(path), self._convert_tokenizer(path))
        return self._cached(path, "meta.done")

    @classmethod
    def can_load(cls, path: str) -> bool:
        return path.endswith(".gguf") and os.path.isfile(path)

    def _reader(self, path: str):
        if path not in self._readers:
            import gguf

            self._readers[path] = gguf.GGUFReader(path)
        return self._readers[path]

    def _fields(self, path: str) -> dict[str, Any]:
        out = {}
        for key, field in self._reader(path).fields.items():
            if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in (
                "tokens",
                "merges",
                "token_type",
                "scores",
            ):
                continue  # large arrays: the tokenizer is built by transformers
            try:
                out[key] = field.contents()
            except Exception:  # an odd field type must not stop loading
                continue
        return out

    def load_hf_config(self, path: str) -> Any:
        from transformers import AutoConfig

        cached = self._ensure_cache(path)
        if cached is not None:
            return AutoConfig.from_pretrained(cached)
        return self._convert_config(path)

    def _convert_config(self, path: str) -> Any:
        from transformers import AutoConfig

        meta = self._fields(path)
        arch = meta.get("general.architecture")
        if arch not in ("llama", "mistral"):
            # transformers knows more GGUF architectures; it is slower (reads all tensors).
            return AutoConfig.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path)
            )

        def g(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        tensor_names = {t.name for t in self._reader(path).tensors}
        num_heads = int(g("attention.head_count"))
        hidden = int(g("embedding_length"))
        vocab = g("vocab_size")
        if vocab is None:
            vocab = len(self._reader(path).fields["tokenizer.ggml.tokens"].data)
        theta = float(g("rope.freq_base", 10000.0))
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        if g("rope.scaling.type") == "linear":
            rope = {
                "rope_type": "linear",
                "rope_theta": theta,
                "factor": float(g("rope.scaling.factor")),
            }
        kwargs = dict(
            architectures=[GGUF_ARCHITECTURES[arch]],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(g("feed_forward_length")),
            num_hidden_layers=int(g("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(g("attention.head_count_kv", num_heads)),
            head_dim=int(g("attention.key_length", hidden // num_heads)),
            max_position_embeddings=int(g("context_length", 2048)),
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
        config = AutoConfig.for_model("llama", **kwargs)
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = rope
        else:  # transformers 4.x
            config.rope_theta = theta
            config.rope_scaling = (
                None
                if rope["rope_type"] == "default"
                else {"type": "linear", "factor": rope["factor"]}
            )
        return config

    def load_tokenizer(self, path: str) -> Any:
        from transformers import AutoTokenizer

        cached = self._ensure_cache(path)
        if cached is not None:
            return AutoTokenizer.from_pretrained(cached)
        return self._convert_tokenizer(path)

    def _convert_tokenizer(self, path: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        )

    def iterate_weights(self, path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor) pairs equal to what transformers loads from the file."""
        cached = self._cached(path, "weights.done")
        if cached is not None:
            from safetensors import safe_open

            with safe_open(os.path.join(cached, "model.safetensors"), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)
            return
        yield from self._dequantized(path, hf_config)

    def _dequantized(self, path: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", num_heads)
        tensors = self._reader(path).tensors
        for t in tqdm(tensors, desc="Loading GGUF", unit="tensor", leave=False):
            name = gguf_to_hf_name(t.name)
            if name is None:
                continue
            w = dequantize(t.data, t.tensor_type)
            w = np.array(w, dtype=np.float32)  # a writable copy (the reader memory-maps)
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                w = unpermute_rotary(w, num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                w = unpermute_rotary(w, num_kv_heads)
            yield name, torch.from_numpy(w)

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        model = build_model(model_config, device_config)
        model.load_weights(self.iterate_weights(model_config.path, model_config.hf_config))
        return process_weights_after_loading(model)
