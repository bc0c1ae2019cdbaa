"""``ServerArgs`` (the frozen sections of ``sections.py``, ``http_args.py`` and
``lora_args.py``, built from flat flag-named keyword arguments), the CLI generated from the sections, and the device-dependent defaults."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from loom.config.http_args import HTTPArgs
from loom.config.lora_args import LoRAArgs
from loom.config.parallel_args import ParallelArgs
from loom.config.sections import (
    CacheArgs,
    GrammarArgs,
    KernelArgs,
    ModelArgs,
    SamplingArgs,
    SchedulerArgs,
)


@dataclass(frozen=True)
class DeviceDefaults:
    """What a flag left unset means on one kind of device."""

    chunked_prefill_size: int
    mem_fraction_static: float  # of the GPU's memory, or of the host's free memory
    max_running_requests: int  # at most, when derived from the KV pool's size
    max_total_tokens: int | None  # at most, when derived from memory (None: no cap)
    cuda_graph_max_bs: int


# On the H200 the 1000-request Llama-3-8B workload ran at 10,017 output tok/s with 1024 running
# requests against 9,712 with 512 (docs/benchmarks.md): larger batches prefill in larger steps.
DEVICE_DEFAULTS = {
    "cuda": DeviceDefaults(8192, 0.85, 1024, None, 1024),
    "cpu": DeviceDefaults(1024, 0.25, 512, 1 << 18, 0),
}


def device_defaults(device_type: str) -> DeviceDefaults:
    return DEVICE_DEFAULTS.get(device_type, DEVICE_DEFAULTS["cpu"])


# ServerArgs' sections: attribute name -> section class
SECTIONS: dict[str, type] = {
    "model_args": ModelArgs,
    "cache_args": CacheArgs,
    "scheduler_args": SchedulerArgs,
    "sampling_args": SamplingArgs,
    "lora_args": LoRAArgs,
    "grammar_args": GrammarArgs,
    "kernel_args": KernelArgs,
    "parallel_args": ParallelArgs,
    "http_args": HTTPArgs,
}
_SECTION_OF = {f.name: attr for attr, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


class ServerArgs:
    """Every server argument, as frozen sections (``model_args``, ``cache_args``, ...); built
    from flat keyword arguments named after the flags (``ServerArgs(page_size=16)``), and a
    flag's value reads flat too (``args.page_size``)."""

    __slots__ = tuple(SECTIONS)

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_SECTION_OF))
        if unknown:
            raise TypeError(
                f"unknown server argument(s): {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(_SECTION_OF))}"
            )
        for attr, cls in SECTIONS.items():
            own = {k: v for k, v in kwargs.items() if _SECTION_OF[k] == attr}
            object.__setattr__(self, attr, cls(**own))
        if self.enable_torch_compile:
            # refused here, before any rank starts (each rank's warm-up would run alone, out of
            # step with the others' collectives; LoRA batches never reach a compiled step)
            if self.enable_lora:
                raise ValueError("--enable-torch-compile does not combine with --enable-lora")
            if self.tp_size > 1:
                raise ValueError("--enable-torch-compile does not combine with --tp-size > 1")

    def __getattr__(self, name: str) -> Any:
        attr = _SECTION_OF.get(name) if not name.startswith("__") else None
        if attr is None:
            raise AttributeError(f"ServerArgs has no argument {name!r}")
        return getattr(object.__getattribute__(self, attr), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to ServerArgs.{name}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerArgs) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, a) for a in SECTIONS))

    def __repr__(self) -> str:
        return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"

    def __reduce__(self):
        return (_rebuild, (self.to_dict(),))

    def to_dict(self) -> dict[str, Any]:
        """Every argument by its flag name."""
        out: dict[str, Any] = {}
        for attr in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, attr)))
        return out

    def replace(self, **changes: Any) -> ServerArgs:
        return ServerArgs(**{**self.to_dict(), **changes})

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return [f for sec in SECTIONS.values() for f in dataclasses.fields(sec)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from Engine keyword arguments (CLI flag names with underscores)."""
        if "model_path" in kwargs:
            kwargs["model"] = kwargs.pop("model_path")
        return cls(**kwargs)

    # ---- CLI generation -------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        from loom import plugins

        for sec in SECTIONS.values():
            group = parser.add_argument_group(f"server arguments: {sec.__doc__.rstrip('.')}")
            for f in dataclasses.fields(sec):
                _add_flag(group, f, plugins)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in cls.fields()})


def _rebuild(kwargs: dict[str, Any]) -> ServerArgs:
    return ServerArgs(**kwargs)


def _add_flag(group, f: dataclasses.Field, plugins) -> None:
    meta = f.metadata
    flag = "--" + f.name.replace("_", "-")
    names = [flag, *meta.get("aliases", ())]
    kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
    if f.type in ("bool", bool):
        kwargs["action"] = argparse.BooleanOptionalAction
    elif str(f.type).startswith("tuple"):
        kwargs["nargs"] = "+"
    else:
        kwargs["type"] = _parse_type(f.type)
        choices = meta.get("choices")
        if meta.get("family"):
            choices = (*meta.get("extra_choices", ()), *plugins.names(meta["family"]))
        if choices:
            kwargs["choices"] = choices
        kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else f.name.upper()
    if f.default is not None and "action" not in kwargs:
        kwargs["help"] += f" (default: {f.default})"
    group.add_argument(*names, **kwargs)


def _parse_type(annotation: Any):
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
