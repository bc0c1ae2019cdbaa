"""``--lora-paths`` entries and the adapter references they name (``LoRARef``: one load of an
adapter, with a unique id). A start-up adapter's id is derived from its name and path, so every
process that parses the flag (the front end and the scheduler) gives it the same id.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field


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
