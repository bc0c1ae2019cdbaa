"""The one plug-in registry.

Every extension point of Loom is a *family* declared once in ``FAMILIES`` below: its name, the
interface its members implement (an ABC whose docstrings state the contract), the CLI flag that
picks a member and the default. Members are registered with :func:`register` (a class, a factory,
or a lazy ``"package.module:Name"`` string so that registering never imports heavy code) and looked
up with :func:`resolve`.

Out-of-tree plug-ins are discovered through the entry-point group ``loom.plugins``: each entry
point is a zero-argument callable that calls :func:`register`. Discovery runs once per process
(front end, scheduler, each tensor-parallel rank) before arguments are parsed, so ``--help`` and
flag choices include out-of-tree names. ``LOOM_PLUGINS`` (a comma list of entry-point names)
restricts which load. A plug-in that fails to import is recorded, not fatal, until somebody asks
for one of its names.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from loom import env

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "loom.plugins"
BUILTIN = "built-in"


@dataclass(frozen=True)
class Family:
    name: str
    interface: str  # "module:Class" of the ABC every member implements
    flag: str  # the CLI flag (or request field) that picks a member
    default: str | None
    doc: str


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "model",
            "loom.models.base:CausalLM",
            "HF config `architectures`",
            None,
            "Model architectures, keyed by the HF `architectures` name.",
        ),
        Family(
            "attention_backend",
            "loom.layers.attention.base:AttentionBackend",
            "--attention-backend",
            "auto",
            "Attention kernels over the paged KV pool.",
        ),
        Family(
            "grammar_backend",
            "loom.constrained.base:GrammarBackend",
            "--grammar-backend",
            "xgrammar",
            "Structured-output grammar compilers and matchers.",
        ),
        Family(
            "radix_eviction_policy",
            "loom.mem_cache.base:RadixEvictionPolicy",
            "--radix-eviction-policy",
            "lru",
            "Which radix-cache leaf is evicted first.",
        ),
        Family(
            "lora_backend",
            "loom.lora.backends:LoRABackend",
            "--lora-backend",
            "auto",
            "How a batch's LoRA adapter updates are computed over the slot pool.",
        ),
        Family(
            "lora_eviction_policy",
            "loom.lora.base:LoRAEvictionPolicy",
            "--lora-eviction-policy",
            "lru",
            "Which LoRA adapter leaves the device pool first.",
        ),
        Family(
            "hicache_storage",
            "loom.mem_cache.base:HiCacheStorage",
            "--hicache-storage-backend",
            None,
            "Third-tier storage of KV pages for the hierarchical cache.",
        ),
        Family(
            "model_loader",
            "loom.model_loader.base:ModelLoader",
            "--load-format",
            "auto",
            "Turn a model path into a model with weights.",
        ),
        Family(
            "quantization",
            "loom.layers.quantization.base:QuantizationConfig",
            "--quantization",
            None,
            "How linear layers store and multiply their weights.",
        ),
        Family(
            "logits_processor",
            "loom.sampling.base:LogitsProcessor",
            "request field `custom_logit_processor`",
            None,
            "Named logits processors installed on the server.",
        ),
        Family(
            "schedule_policy",
            "loom.scheduler.base:SchedulePolicy",
            "--schedule-policy",
            "fcfs",
            "Order of the waiting queue.",
        ),
        Family(
            "tool_call_parser",
            "loom.function_call.base:ToolCallParser",
            "--tool-call-parser",
            "auto",
            "Tool-call formats models write, found in chat completions' output.",
        ),
    ]
}


@dataclass
class Entry:
    family: str
    name: str
    target: Any  # an object, or a lazy "module:Name" string
    origin: str = BUILTIN
    requires: tuple[str, ...] = ()  # optional import names the member needs
    resolved: Any = None


@dataclass
class _State:
    entries: dict[str, dict[str, Entry]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # plug-in name -> error
    discovered: bool = False
    current_origin: str = BUILTIN


_state = _State(entries={name: {} for name in FAMILIES})
_lock = threading.RLock()


class RegistryError(LookupError):
    """A registry lookup or registration failed; the message says why and what is available."""


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise RegistryError(f"unknown plug-in family {family!r}; families: {', '.join(FAMILIES)}")


def register(
    family: str,
    name: str,
    target: Any,
    override: bool = False,
    requires: tuple[str, ...] | list[str] = (),
) -> None:
    """Register ``target`` as ``name`` in ``family``.

    ``target`` is a class or factory, or a lazy ``"package.module:Name"`` string imported on first
    :func:`resolve`. ``requires`` names optional modules the member needs (shown by
    ``loom plugins``). A duplicate name raises unless ``override=True``.
    """
    _check_family(family)
    ensure_loaded()  # built-ins first, so that a plug-in can override them deliberately
    with _lock:
        members = _state.entries[family]
        if name in members and not override:
            prev = members[name]
            raise RegistryError(
                f"{family} {name!r} is already registered (by {prev.origin}); "
                "pass override=True to replace it"
            )
        members[name] = Entry(family, name, target, _state.current_origin, tuple(requires))


def unregister(family: str, name: str) -> None:
    _check_family(family)
    with _lock:
        _state.entries[family].pop(name, None)


def names(family: str) -> list[str]:
    """Registered names of ``family``, in registration order."""
    _check_family(family)
    ensure_loaded()
    return list(_state.entries[family])


def entries(family: str) -> list[Entry]:
    _check_family(family)
    ensure_loaded()
    return list(_state.entries[family].values())


def failed_plugins() -> dict[str, str]:
    ensure_loaded()
    return dict(_state.failed)


def _import_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def interface(family: str) -> type:
    _check_family(family)
    return _import_target(FAMILIES[family].interface)


def resolve(family: str, name: str) -> Any:
    """Return the class/factory registered as ``name`` in ``family`` (imported and checked)."""
    _check_family(family)
    ensure_loaded()
    with _lock:
        entry = _state.entries[family].get(name)
        if entry is None:
            known = ", ".join(sorted(_state.entries[family])) or "(none)"
            msg = f"unknown {family} {name!r}; registered: {known}"
            if _state.failed:
                fails = "; ".join(f"{p}: {e}" for p, e in _state.failed.items())
                msg += f". Plug-ins that failed to load: {fails}"
            raise RegistryError(msg)
        if entry.resolved is None:
            target = entry.target
            if isinstance(target, str):
                try:
                    target = _import_target(target)
                except ImportError as e:
                    hint = f" (needs: {', '.join(entry.requires)})" if entry.requires else ""
                    raise RegistryError(
                        f"{family} {name!r} could not be imported{hint}: {e}"
                    ) from e
            iface = interface(family)
            if isinstance(target, type) and not issubclass(target, iface):
                raise RegistryError(
                    f"{family} {name!r} ({target.__module__}.{target.__qualname__}) "
                    f"does not implement {iface.__module__}.{iface.__qualname__}"
                )
            entry.resolved = target
        return entry.resolved


def is_available(entry: Entry) -> tuple[bool, str]:
    """Whether the member's optional dependencies are importable (without importing them)."""
    missing = [m for m in entry.requires if importlib.util.find_spec(m) is None]
    if missing:
        return False, "missing " + ", ".join(missing)
    return True, "ok"


def _register_builtins() -> None:
    from loom.builtins import BUILTINS, REQUIRES

    for family, members in BUILTINS.items():
        for name, target in members.items():
            register(family, name, target, requires=REQUIRES.get((family, name), ()))


def ensure_loaded() -> None:
    """Register built-ins and discover entry-point plug-ins, once per process."""
    if _state.discovered:
        return
    with _lock:
        if _state.discovered:
            return
        _state.discovered = True
        _register_builtins()
        _discover_entry_points()


def _discover_entry_points() -> None:
    from importlib.metadata import entry_points

    allowed = env.plugin_allow_list()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else ep.value
        _state.current_origin = origin
        try:
            fn = ep.load()
            fn()
        except Exception as e:  # a broken plug-in must not take Loom down
            _state.failed[ep.name] = f"{type(e).__name__}: {e}"
            logger.warning("loom plug-in %r failed to load: %s", ep.name, e)
        finally:
            _state.current_origin = BUILTIN


def reset_for_tests() -> None:
    """Forget everything (tests only): the next lookup re-registers built-ins and re-discovers."""
    with _lock:
        _state.entries = {name: {} for name in FAMILIES}
        _state.failed = {}
        _state.discovered = False
