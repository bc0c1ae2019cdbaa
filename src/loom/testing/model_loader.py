"""Conformance kit of the model_loader family: config, tokenizer and a fully written model from a
checkpoint, against HF transformers' model loaded from the same files."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

from loom import plugins
from loom.testing._common import (
    poisoned_parameters,
    save_tiny_llama,
    tiny_llama_config,
    unwritten_parameters,
)
from loom.testing.model import compare_forwards

# config fields a loader's config must share with the reference's
_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def _reference(reference: Any, path: str) -> nn.Module | None:
    from transformers import AutoModelForCausalLM

    if reference is None or isinstance(reference, nn.Module):
        return reference
    if reference == "auto":
        if path.endswith(".gguf"):  # transformers dequantises GGUF itself (slowly)
            d, f = os.path.split(path)
            return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        reference = path
    return AutoModelForCausalLM.from_pretrained(
        reference, dtype=torch.float32, local_files_only=True
    ).eval()


def _raises_naming(name: str, what: str, path: str, call: Any) -> bool:
    """Whether ``call()`` raised; if it raised, the error must be an OSError or ValueError that
    names ``path``."""
    try:
        call()
    except (OSError, ValueError) as e:
        assert os.path.basename(path) in str(e), f"{name}: {what} of a missing path: {e!r}"
        return True
    except Exception as e:
        raise AssertionError(f"{name}: {what} of a missing path raised {e!r}") from e
    return False


def check_model_loader(
    loader: str | type,
    path: str | None = None,
    reference: str | nn.Module | None = "auto",
    device: str | torch.device = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    atol: float = 1e-4,
    seed: int = 0,
    attention_backend: str = "torch_native",
) -> None:
    """``loader``: a registered ``--load-format`` name or a ``ModelLoader`` class. ``path``: a
    checkpoint in its format (default: a tiny random HF Llama directory, safetensors and a
    tokenizer, written by the kit). ``reference``: the oracle, HF transformers' model of the same
    weights (``"auto"``: loaded by transformers from ``path``; an HF directory; a model; None:
    none, e.g. for random weights).

    Checks: a missing path is not ``can_load``-ed, and reading it raises an OSError/ValueError
    naming it; ``load_hf_config`` gives ``architectures`` naming a registered model, shaped as
    the reference's config; ``load_tokenizer`` gives None or a tokenizer whose ids fit the
    vocabulary; ``load_model`` returns an ``eval()`` instance of that model's class on the
    device, in each of ``dtypes``, with every parameter written (parameters start as NaN), whose
    fp32 logits over extend and decode batches equal the reference's."""
    from loom.model_loader.base import DeviceConfig, ModelConfig, ModelLoader

    cls = plugins.resolve("model_loader", loader) if isinstance(loader, str) else loader
    name = loader if isinstance(loader, str) else getattr(cls, "__name__", repr(cls))
    assert isinstance(cls, type) and issubclass(cls, ModelLoader), (
        f"{name}: a loader must be a subclass of loom.model_loader.base.ModelLoader"
    )
    device = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="loom-kit-loader-") as tmp:
        if path is None:
            path = os.path.join(tmp, "tiny-llama")
            save_tiny_llama(path, tiny_llama_config(), seed)
        missing = os.path.join(tmp, "no-such-model")
        assert cls.can_load(missing) is False, f"{name}: can_load of a missing path must be False"
        assert _raises_naming(
            name, "load_hf_config", missing, lambda: cls().load_hf_config(missing)
        ), f"{name}: load_hf_config of a missing path must raise"
        _raises_naming(name, "load_tokenizer", missing, lambda: cls().load_tokenizer(missing))

        ref = _reference(reference, path)
        inst = cls()
        config = inst.load_hf_config(path)
        archs = getattr(config, "architectures", None)
        assert archs and all(isinstance(a, str) for a in archs), (
            f"{name}: load_hf_config must give a config with `architectures`, not {archs!r}"
        )
        try:
            model_cls = plugins.resolve("model", archs[0])
        except plugins.RegistryError as e:
            raise AssertionError(f"{name}: the config names no registered model: {e}") from e
        if ref is not None:
            for field in _SHAPE_FIELDS:
                if hasattr(ref.config, field):
                    got, want = getattr(config, field, None), getattr(ref.config, field)
                    assert got == want, f"{name}: config {field} is {got!r}, reference {want!r}"

        tok = inst.load_tokenizer(path)
        if tok is not None:
            ids = tok.encode("t5 t9 hello world")
            assert ids and all(isinstance(i, int) and 0 <= i < config.vocab_size for i in ids), (
                f"{name}: tokenizer ids {ids} do not fit the vocabulary of {config.vocab_size}"
            )
            assert isinstance(tok.decode(ids), str), f"{name}: tokenizer.decode must give a str"

        for dtype in dtypes:
            model_config = ModelConfig(
                path=path,
                hf_config=config,
                dtype=dtype,
                context_len=getattr(config, "max_position_embeddings", 2048),
                architecture=archs[0],
                seed=seed,
            )
            with poisoned_parameters():
                try:
                    model = inst.load_model(model_config, DeviceConfig(device))
                except Exception as e:
                    raise AssertionError(f"{name}: load_model failed on {path}: {e!r}") from e
            what = f"{name}: load_model ({dtype})"
            assert isinstance(model, model_cls), f"{what} must build {model_cls.__name__}"
            assert not model.training, f"{what} must return an eval() model"
            for n, p in model.named_parameters():
                assert p.device.type == device.type, f"{what}: {n} is on {p.device}"
                assert not p.is_floating_point() or p.dtype == dtype, f"{what}: {n} is {p.dtype}"
            unwritten = unwritten_parameters(model)
            assert not unwritten, f"{what} never wrote {unwritten[:4]}"
            if dtype == torch.float32:
                compare_forwards(
                    name, model, config, ref, device, dtype, atol, seed, attention_backend
                )
            del model

        # a model path that vanished: loading may succeed (random weights) or name the path
        gone = ModelConfig(missing, config, torch.float32, 256, archs[0], seed)
        _raises_naming(
            name, "load_model", missing, lambda: cls().load_model(gone, DeviceConfig(device))
        )
