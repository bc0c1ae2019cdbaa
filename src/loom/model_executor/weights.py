"""The model's weights as the runner holds them: the loader and config a model is built from
(``model_config_for``), the load's log line, and swapping in another checkpoint in place
(``swap_weights``, behind ``update_weights_from_disk``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from loom import plugins
from loom.layers.rotary import context_length
from loom.model_loader.base import DeviceConfig, ModelConfig, ModelLoader
from loom.model_loader.model_path import resolve_model_path

if TYPE_CHECKING:
    from loom.config import ServerArgs

logger = logging.getLogger(__name__)


def model_config_for(
    args: ServerArgs, dtype: torch.dtype, loader=None
) -> tuple[ModelLoader, ModelConfig]:
    """The loader (``args.load_format``'s unless given) and the model's config as the runner
    builds the model from them."""
    if loader is None:
        loader = plugins.resolve("model_loader", args.load_format)()
    path = resolve_model_path(args.model)
    hf_config = loader.load_hf_config(path)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"the model config at {path} names no `architectures`")
    model_context = context_length(hf_config)
    if args.context_length is not None and args.context_length > model_context:
        raise ValueError(
            f"--context-length {args.context_length} is longer than the model's "
            f"{model_context} (max_position_embeddings with its rope scaling): positions past "
            "it were never trained and have no rotary table"
        )
    quant_config = None
    implied = loader.quantization
    if implied and args.quantization not in (None, implied):
        raise ValueError(
            f"--load-format {args.load_format} loads with --quantization {implied}, not "
            f"{args.quantization}"
        )
    name = args.quantization or implied or checkpoint_quantization(path, hf_config)
    if name is not None:
        cls = plugins.resolve("quantization", name)
        quant_config = cls.from_model(path, hf_config)
    return loader, ModelConfig(
        path=path,
        hf_config=hf_config,
        dtype=dtype,
        context_len=args.context_length or model_context,
        architecture=archs[0],
        seed=args.random_seed,
        model_impl=args.model_impl,
        quant_config=quant_config,
    )


def checkpoint_quantization(path: str, hf_config) -> str | None:
    """The registered ``--quantization`` member whose format the checkpoint is stored in
    (``QuantizationConfig.detects``: an FP8 checkpoint's ``quantization_config``, a ModelOpt
    export's ``hf_quant_config.json``), or None for plain weights. A ``quantization_config``
    no member reads is refused by name rather than loaded as dense weights. GGUF files load
    dequantized unless ``--quantization gguf`` asks."""
    if path.endswith(".gguf"):
        return None
    for name in plugins.names("quantization"):
        try:
            cls = plugins.resolve("quantization", name)
        except plugins.RegistryError:  # a member that cannot import here detects nothing
            continue
        if cls.detects(path, hf_config):
            return name
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method")
    raise ValueError(
        f"{path} is quantized with {method!r}, which Loom does not read (--quantization: "
        f"{', '.join(plugins.names('quantization'))})"
    )


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (a quantized layer's packed tensors are
    buffers), and the tensors modules derive from them when loaded (plain attributes: the
    LM head's GEMV layout, Gemma's norm scales)."""
    out = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{attr}" if prefix else attr] = value
    return out


def log_load(model: torch.nn.Module, device: torch.device, seconds: float) -> None:
    """One line: load time, the weights' bytes and the peak memory of the load (the device's
    allocator on CUDA, the process's resident peak on CPU)."""
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    if device.type == "cuda":
        peak = f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    else:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak = f"peak process memory {rss / 2**30:.2f} GiB"
    logger.info("loaded the model in %.1f s: weights %.2f GiB, %s", seconds, weights / 2**30, peak)


def _load_checked(model, current: ModelConfig, args: ServerArgs, dtype, device):
    """The checkpoint ``args`` names, loaded whole and checked against ``model``: (loader,
    config, {name: (old, new)}); a ValueError naming the first difference."""
    loader, config = model_config_for(args, dtype)
    path = config.path
    if config.architecture != current.architecture:
        raise ValueError(
            f"{path} is a {config.architecture}, this server runs a {current.architecture}"
        )
    new = loader.load_model(config, DeviceConfig(device))
    old_tensors, new_tensors = model_tensors(model), model_tensors(new)
    if old_tensors.keys() != new_tensors.keys():
        diff = sorted(old_tensors.keys() ^ new_tensors.keys())
        raise ValueError(f"{path}: its model's tensors differ from this one's: {diff[:4]}")
    for name, old in old_tensors.items():
        t = new_tensors[name]
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(
                f"{path}: {name} is {t.dtype} {tuple(t.shape)}, this model's "
                f"{old.dtype} {tuple(old.shape)}"
            )
    return loader, config, {name: (old, new_tensors[name]) for name, old in old_tensors.items()}


def swap_weights(
    model: torch.nn.Module,
    current: ModelConfig,
    args: ServerArgs,
    dtype: torch.dtype,
    device: torch.device,
    agree: Callable[[str | None], str | None] | None = None,
) -> tuple[ModelLoader, ModelConfig]:
    """Load the checkpoint ``args`` names (its ``model`` and ``load_format``) into a new model
    and copy its tensors into ``model``'s in place, so that CUDA graphs and kernels keep their
    addresses; returns the new loader and config. Raises ValueError when it cannot (another
    architecture, a tensor of another name, shape or dtype, files it cannot read) with
    ``model`` untouched; the new model is built whole first, so this needs memory for a second
    copy of the weights. ``agree`` (tensor parallelism): given this rank's error or None before
    anything is copied, returns the first error of any rank or None, so that every rank copies
    or none does."""
    start = time.perf_counter()
    error, ready = None, None
    try:
        ready = _load_checked(model, current, args, dtype, device)
    except Exception as e:  # noqa: BLE001 - the model is untouched: reported, not fatal
        error = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    if agree is not None:
        error = agree(error)
    if error is not None:
        raise ValueError(error)
    loader, config, pairs = ready
    with torch.inference_mode():
        for old, new in pairs.values():
            old.copy_(new)
    logger.info("weights updated from %s in %.1f s", config.path, time.perf_counter() - start)
    return loader, config
