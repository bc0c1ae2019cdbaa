"""``--load-format layered``: a safetensors checkpoint loaded one decoder layer at a time, so
the peak memory of loading is about the final weights plus one layer.

The model is built with its parameters on the meta device (shapes and dtypes, no storage); its
buffers (rotary tables) are built where they run. The checkpoint's tensors are read in groups:
everything outside the decoder layers (embeddings, final norm, LM head) first, then layer 0,
1, .... Before a group's first tensor is handed to the model's ``load_weights``, that group's
parameters get their storage on the device; once its last tensor is loaded, its modules'
``process_weights_after_loading`` run, which is where a ``--quantization`` method quantizes
(``fp8`` turns the layer's dense weights into E4M3 and frees them), before the next layer's
dense weights exist. Each group reads its files through its own ``safe_open``, so no more than
one group's pages of the file stay mapped.

Only Loom's own implementations are loaded this way (the transformers fallback builds its
parameters through transformers and is refused by name).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from loom.model_loader.base import TRANSFORMERS_FALLBACK, DeviceConfig, ModelConfig, build_model
from loom.model_loader.loaders import SafetensorsLoader, _safetensors_files

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
OUTSIDE = -1  # the group of everything outside the decoder layers
FALLBACK_MODULE = TRANSFORMERS_FALLBACK.partition(":")[0]


def layer_of(name: str) -> int:
    """The decoder layer a parameter, module or checkpoint tensor belongs to, or OUTSIDE."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else OUTSIDE


@contextlib.contextmanager
def parameters_on_meta():
    """Inside the block, every parameter a module registers is moved to the meta device
    (keeping its attributes, e.g. ``weight_loader``); buffers stay where they were built. A
    parameter's storage exists only between its factory call and its registration."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _stale(param: nn.Parameter, *args, **kwargs) -> None:
    raise RuntimeError(
        "a weight was loaded into a parameter replaced by --load-format layered: the model's "
        "load_weights must look parameters up as it loads them (weight_utils.live)"
    )


class _Groups:
    """The model's parameters and modules by group, and their materialisation."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        # one parameter object may sit in several modules (tied embeddings)
        self.slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
        self.params: dict[int, dict[int, nn.Parameter]] = defaultdict(dict)
        for prefix, module in model.named_modules(remove_duplicate=False):
            for leaf, p in module._parameters.items():
                if p is None:
                    continue
                self.slots[id(p)].append((module, leaf))
                full = f"{prefix}.{leaf}" if prefix else leaf
                # a tied parameter belongs to the first group that names it
                if not any(id(p) in g for g in self.params.values()):
                    self.params[layer_of(full)][id(p)] = p
        self.modules: dict[int, list[nn.Module]] = defaultdict(list)
        for prefix, module in model.named_modules():
            self.modules[layer_of(prefix)].append(module)
        self.done: set[int] = set()

    def materialize(self, group: int) -> None:
        for p in self.params.pop(group, {}).values():
            real = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=self.device), requires_grad=False
            )
            real.__dict__.update(p.__dict__)
            for module, leaf in self.slots[id(p)]:
                module._parameters[leaf] = real
            # A loader still holding the meta parameter must not write into it unnoticed.
            p.weight_loader = _stale

    def finish(self, group: int) -> None:
        """The group's modules turn their loaded weights into the form they run with."""
        if group in self.done:
            return
        self.done.add(group)
        for module in self.modules.get(group, []):
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()


class LayeredLoader(SafetensorsLoader):
    """An HF safetensors directory, loaded (and quantized) one decoder layer at a time."""

    @classmethod
    def can_load(cls, path: str) -> bool:
        return False  # picked by name only: auto prefers the plain loader

    def _tensors_by_group(self, path: str) -> dict[int, list[tuple[str, list[str]]]]:
        """Each group's tensors, as (file, names) in file order."""
        from safetensors import safe_open

        files = _safetensors_files(path)
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        groups: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    groups[layer_of(name)][file].append(name)
        return {g: list(by_file.items()) for g, by_file in groups.items()}

    def load_model(self, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        from safetensors import safe_open

        by_group = self._tensors_by_group(model_config.path)

        def read(group: int) -> Iterator[tuple[str, torch.Tensor]]:
            for file, names in by_group[group]:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in names:
                        yield name, f.get_tensor(name)

        total = sum(len(names) for items in by_group.values() for _, names in items)
        return load_by_group(model_config, device_config, sorted(by_group), read, total)


def load_by_group(
    model_config: ModelConfig,
    device_config: DeviceConfig,
    groups_present: list[int],
    read: Callable[[int], Iterator[tuple[str, torch.Tensor]]],
    total: int,
    desc: str = "Loading layers",
    regroup: bool = True,
) -> nn.Module:
    """Build the model on the meta device and load it one group at a time: ``read(group)``
    yields a group's checkpoint tensors (``groups_present``: the groups the checkpoint has, in
    order); ``regroup``: pass them through the quantization's ``checkpoint_tensors``."""
    with parameters_on_meta():
        model = build_model(model_config, device_config)
    if type(model).__module__ == FALLBACK_MODULE:
        raise ValueError(
            "--load-format layered needs Loom's own implementation of the model, not "
            "transformers' modeling code (--model-impl transformers)"
        )
    groups = _Groups(model, device_config.device)
    progress = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    def counted(group: int) -> Iterator[tuple[str, torch.Tensor]]:
        for item in read(group):
            yield item
            progress.update()

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        # A generator resumes only when load_weights asks for the next tensor, so every tensor
        # yielded before has been written into its parameter.
        quant = model_config.quant_config
        for group in groups_present:
            groups.materialize(group)
            tensors = counted(group)
            if quant is not None and regroup:
                # a quantization member regroups a layer's tensors within the layer
                tensors = quant.checkpoint_tensors(tensors)
            yield from tensors
            if group != OUTSIDE:  # outside modules (the LM head) may read layers' state
                groups.finish(group)

    try:
        model.load_weights(weights())
    finally:
        progress.close()
    for group in sorted(groups.modules):
        groups.finish(group)
    return model.eval()
