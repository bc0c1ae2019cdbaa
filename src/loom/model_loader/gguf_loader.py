"""GGUF files (llama.cpp's format): config and weights as llama.cpp's converter laid them out
for each architecture (``gguf_layouts``), the tokenizer and chat template through transformers'
GGUF tokenizer conversion, weights dequantised with the ``gguf`` package (F32/F16/BF16/Q8_0/
Q4_0/Q4_1 and the K-quants it supports) into the HF checkpoint names Loom's models load.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from loom import env
from loom.model_loader.base import (
    TRANSFORMERS_FALLBACK,
    DeviceConfig,
    ModelConfig,
    ModelLoader,
    build_model,
    process_weights_after_loading,
    resolve_model_class,
)
from loom.model_loader.gguf_layouts import LAYOUTS, Metadata, layout_for, unpermute_rotary

logger = logging.getLogger(__name__)

__all__ = ["GGUFLoader", "gguf_to_hf_name", "unpermute_rotary"]

# Converting a GGUF's tokenizer and parsing its metadata takes seconds; both are cached on disk
# (keyed by the file's name, size and mtime), each part on its own. For files under this size
# the dequantised weights are cached too (as fp32 safetensors): a restart then takes a second.
_WEIGHT_CACHE_MAX_FILE_BYTES = 512 * 2**20
# tokenizer arrays too large to read into the metadata (transformers reads them itself)
_TOKENIZER_ARRAYS = ("tokens", "merges", "token_type", "scores")
FALLBACK_MODULE = TRANSFORMERS_FALLBACK.partition(":")[0]


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF checkpoint name of a tensor of a GGUF file of ``arch`` (None: not a weight)."""
    return LAYOUTS[arch].hf_name(name)


class GGUFLoader(ModelLoader):
    def __init__(self) -> None:
        self._readers: dict[str, Any] = {}
        self._metas: dict[str, Metadata] = {}

    @classmethod
    def can_load(cls, path: str) -> bool:
        return path.endswith(".gguf") and os.path.isfile(path)

    # ---- the on-disk cache: one directory per part (config, tokenizer, weights) ----------

    def _cache_dir(self, path: str) -> str | None:
        if not env.gguf_cache_enabled():
            return None
        st = os.stat(path)
        stem = os.path.basename(path).removesuffix(".gguf")
        # "gguf-v2": the per-architecture layouts; earlier caches are not read
        return os.path.join(env.cache_root(), "gguf-v2", f"{stem}-{st.st_size}-{int(st.st_mtime)}")

    def _cached(self, path: str, part: str) -> str | None:
        d = self._cache_dir(path)
        return os.path.join(d, part) if d and os.path.isdir(os.path.join(d, part)) else None

    def _store(self, path: str, part: str, write: Callable[[str], None]) -> None:
        """Write one part of the cache atomically; a failure only costs the cache."""
        d = self._cache_dir(path)
        if d is None:
            return
        os.makedirs(d, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=d, prefix=f".tmp-{part}-")
        try:
            write(tmp)
            os.rename(tmp, os.path.join(d, part))
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:
            logger.warning("could not cache the GGUF %s in %s: %s", part, d, e)
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- the file ---------------------------------------------------------------------------

    def _reader(self, path: str) -> gguf.GGUFReader:
        if path not in self._readers:
            self._readers[path] = gguf.GGUFReader(path)
        return self._readers[path]

    def _metadata(self, path: str) -> Metadata:
        if path not in self._metas:
            reader = self._reader(path)
            fields = {}
            for key, field in reader.fields.items():
                if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in _TOKENIZER_ARRAYS:
                    continue
                try:
                    fields[key] = field.contents()
                except Exception:  # an odd field type must not stop loading
                    continue
            self._metas[path] = Metadata(fields, {t.name: t for t in reader.tensors})
        return self._metas[path]

    # ---- config -----------------------------------------------------------------------------

    def load_hf_config(self, path: str) -> Any:
        from transformers import AutoConfig

        cached = self._cached(path, "config")
        if cached is not None:
            return AutoConfig.from_pretrained(cached)
        meta = self._metadata(path)
        config = layout_for(meta).hf_config(meta)
        self._store(path, "config", config.save_pretrained)
        return config

    # ---- tokenizer --------------------------------------------------------------------------

    def load_tokenizer(self, path: str) -> Any:
        from transformers import AutoTokenizer

        if not self.can_load(path):  # --tokenizer-path: an HF tokenizer directory
            return super().load_tokenizer(path)
        cached = self._cached(path, "tokenizer")
        if cached is not None:
            return AutoTokenizer.from_pretrained(cached)
        tokenizer = self._convert_tokenizer(path)
        self._store(path, "tokenizer", tokenizer.save_pretrained)
        return tokenizer

    def _convert_tokenizer(self, path: str) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path)
            )
        except Exception as e:
            meta = self._metadata(path)
            raise ValueError(
                f"{path}: transformers cannot build the tokenizer of this GGUF file (architecture "
                f"{meta.arch!r}, tokenizer.ggml.model {meta.fields.get('tokenizer.ggml.model')!r})"
                f": {e}. Pass --tokenizer-path with the model's HF tokenizer directory, or "
                "--skip-tokenizer-init."
            ) from e

    # ---- weights ----------------------------------------------------------------------------

    def iterate_weights(
        self, path: str, hf_config: Any, quant_config: Any = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF checkpoint name, fp32 tensor) pairs of the file's weights; those
        ``quant_config`` wants in its stored form (``load_form``) as their raw blocks
        (``[rows, bytes]`` uint8, rows in HF order)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        if quant_config is not None:  # (the on-disk cache holds dequantised weights)
            yield from self._dequantized(path, hf_config, quant_config.load_form)
            return
        cached = self._cached(path, "weights")
        if cached is not None:
            with safe_open(os.path.join(cached, "model.safetensors"), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    yield name, f.get_tensor(name)
            return
        if self._cache_dir(path) is None or os.path.getsize(path) > _WEIGHT_CACHE_MAX_FILE_BYTES:
            yield from self._dequantized(path, hf_config)
            return
        weights = dict(self._dequantized(path, hf_config))

        def write(directory: str) -> None:
            save_file(weights, os.path.join(directory, "model.safetensors"))

        self._store(path, "weights", write)
        yield from weights.items()

    def _dequantized(
        self,
        path: str,
        hf_config: Any,
        raw: Callable[[str], bool] = lambda name: False,
        tensors: list | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``tensors``: these of the file's tensors only (with their own progress bar)."""
        layout = layout_for(self._metadata(path))
        if tensors is None:
            tensors = tqdm(
                self._reader(path).tensors, desc="Loading GGUF", unit="tensor", leave=False
            )
        for t in tensors:
            hf = layout.hf_name(t.name)
            keep = hf is not None and raw(hf)
            w = t.data if keep else gguf.quants.dequantize(t.data, t.tensor_type)
            for name, part in layout.hf_tensors(t.name, w, hf_config):
                # a writable copy of its own (the reader memory-maps; experts are slices)
                yield name, torch.from_numpy(np.array(part, dtype=np.uint8 if keep else np.float32))

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        quant = model_config.quant_config
        cls = resolve_model_class(model_config.architecture, model_config.model_impl)
        if quant is not None and cls.__module__ != FALLBACK_MODULE:
            return self._load_by_layer(model_config, device_config)
        model = build_model(model_config, device_config)
        model.load_weights(
            self.iterate_weights(
                model_config.path, model_config.hf_config, model_config.quant_config
            )
        )
        return process_weights_after_loading(model)

    def _load_by_layer(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        """Blocks kept (``--quantization gguf``): built on the meta device and loaded one
        decoder layer at a time (``layered.load_by_group``), so no layer's dense weight ever
        exists (built whole, a model holds them all before the blocks replace them: 1.70x the
        Llama-3-8B shape's Q8_0 weights on the H200)."""
        from loom.model_loader.layered import layer_of, load_by_group

        path, hf_config, quant = (
            model_config.path,
            model_config.hf_config,
            model_config.quant_config,
        )
        layout = layout_for(self._metadata(path))
        by_group: dict[int, list] = {}
        for t in self._reader(path).tensors:
            by_group.setdefault(layer_of(layout.hf_name(t.name) or ""), []).append(t)

        def read(group: int) -> Iterator[tuple[str, torch.Tensor]]:
            return self._dequantized(path, hf_config, quant.load_form, by_group[group])

        total = sum(len(ts) for ts in by_group.values())
        return load_by_group(
            model_config, device_config, sorted(by_group), read, total, "Loading GGUF", False
        )
