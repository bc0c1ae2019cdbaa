"""The LoRA section of the server arguments (``LoRAArgs``), the ``--lora-paths`` entries and the
adapter references they name (``LoRARef``: one load of an adapter, with a unique id). A start-up
adapter's id is derived from its name and path, so every process that parses the flag (the
front end and the scheduler) gives it the same id.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field

from loom.config.sections import _arg, _positive


@dataclass(frozen=True)
class LoRARef:
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def _startup_id(name: str, path: str) -> str:
    """The id of a ``--lora-paths`` adapter: the same in every process that parses the flag."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"loom-lora:{name}\0{path}").hex


def _ref_of_json(spec: str) -> LoRARef:
    try:
        obj = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lora-paths entry {spec!r}: invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--lora-paths entry {spec!r}: expected a JSON object")
    unknown = set(obj) - {"lora_name", "lora_path", "pinned"}
    if unknown:
        raise ValueError(f"--lora-paths entry {spec!r}: unknown keys {sorted(unknown)}")
    name, path, pinned = obj.get("lora_name"), obj.get("lora_path"), obj.get("pinned", False)
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-paths entry {spec!r}: needs string lora_name and lora_path")
    if not isinstance(pinned, bool):
        raise ValueError(f"--lora-paths entry {spec!r}: pinned must be true or false")
    return LoRARef(name, path, pinned, _startup_id(name, path))


def parse_lora_paths(specs) -> list[LoRARef]:
    """``--lora-paths`` entries: ``NAME=PATH``, a bare ``PATH`` (named after its folder), or
    SGLang's JSON object ``{"lora_name": ..., "lora_path": ..., "pinned": true}``; a dict
    {name: path} from the Python API is taken as is."""
    if not specs:
        return []
    if isinstance(specs, dict):
        specs = [f"{k}={v}" for k, v in specs.items()]
    refs: list[LoRARef] = []
    for spec in specs:
        spec = str(spec)
        if spec.lstrip().startswith("{"):
            ref = _ref_of_json(spec)
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                path, name = spec, os.path.basename(os.path.normpath(spec))
            if not name or not path:
                raise ValueError(f"--lora-paths entry {spec!r}: expected NAME=PATH or PATH")
            ref = LoRARef(name, path, False, _startup_id(name, path))
        if any(r.lora_name == ref.lora_name for r in refs):
            raise ValueError(f"--lora-paths: adapter name {ref.lora_name!r} given twice")
        refs.append(ref)
    return refs


@dataclass(frozen=True)
class LoRAArgs:
    """Multi-LoRA serving."""

    enable_lora: bool = field(
        default=False,
        metadata=_arg("Serve LoRA adapters (implied by --lora-paths)."),
    )
    lora_paths: tuple[str, ...] | None = field(
        default=None,
        metadata=_arg(
            "LoRA adapters to serve, as NAME=PATH, PATH (named after its folder) or "
            '\'{"lora_name": NAME, "lora_path": PATH, "pinned": true}\' (a pinned adapter '
            "keeps its device slot): PEFT checkpoints (adapter_config.json + "
            "adapter_model.safetensors). Requests pick one by name (`lora_path`; OpenAI "
            "routes: model `BASE:NAME` or `NAME`)."
        ),
    )
    max_loras_per_batch: int = field(
        default=8,
        metadata=_arg(
            "Adapter slots on the device: at most this many different adapters run at once "
            "(requests for another wait until a slot's adapter is idle)."
        ),
    )
    max_lora_rank: int | None = field(
        default=None,
        metadata=_arg("Rank of the adapter slots (default: the largest rank of --lora-paths)."),
    )
    max_loaded_loras: int | None = field(
        default=None,
        metadata=_arg(
            "Adapters kept in host memory (default: all). Past it the eviction policy drops "
            "one, which is read from disk again when a request needs it."
        ),
    )
    lora_target_modules: tuple[str, ...] | None = field(
        default=None,
        metadata=_arg(
            "The projections the adapter pool serves (q_proj k_proj v_proj o_proj gate_proj "
            "up_proj down_proj, qkv_proj, gate_up_proj, or all); default: those of "
            "--lora-paths, else all. Adapters loaded later must stay within them."
        ),
    )
    lora_backend: str = field(
        default="auto",
        metadata=_arg(
            "How adapter updates are computed: triton (one shrink and one expand kernel per "
            "projection for every adapter of the batch), torch_native (a matmul pair per "
            "adapter), auto (triton on CUDA, else torch_native).",
            family="lora_backend",
        ),
    )
    lora_eviction_policy: str = field(
        default="lru",
        metadata=_arg(
            "Which idle adapter gives up its device slot first.", family="lora_eviction_policy"
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.lora_paths, dict):
            object.__setattr__(
                self, "lora_paths", tuple(f"{k}={v}" for k, v in self.lora_paths.items())
            )
        elif isinstance(self.lora_paths, (list, str)):
            paths = [self.lora_paths] if isinstance(self.lora_paths, str) else self.lora_paths
            object.__setattr__(self, "lora_paths", tuple(paths))
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        _positive(self, "max_loras_per_batch", "max_lora_rank", "max_loaded_loras")
        if isinstance(self.lora_target_modules, (list, str)):
            mods = self.lora_target_modules
            object.__setattr__(
                self, "lora_target_modules", (mods,) if isinstance(mods, str) else tuple(mods)
            )
        parse_lora_paths(self.lora_paths)  # a malformed entry fails here, naming it
