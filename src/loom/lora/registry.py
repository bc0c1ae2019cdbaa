"""Adapter references and the front end's registry of them.

A ``LoRARef`` is one load of an adapter: a unique id, the name requests use, the path it was
read from, and whether it is pinned to a device slot. The scheduler knows adapters by id only,
so a name unloaded and loaded again (perhaps from other files) is a new adapter there, and a
request sent before the unload can never run on the new weights.

The ``LoRARegistry`` lives on the front end (``Engine``): it maps names to references and counts
each reference's requests in flight (from submission until the front end forgets the request).
An unload takes the name away at once, so no new request can pick it, then waits until the
count falls to zero before the scheduler drops the adapter.
"""

from __future__ import annotations

import threading

from loom.config.lora_args import LoRARef, parse_lora_paths

__all__ = ["LoRARef", "LoRARegistry", "parse_lora_paths"]


class LoRARegistry:
    """Names to references, and each reference's requests in flight. Thread-safe: requests
    are submitted from callers' threads and the HTTP server's event loop."""

    def __init__(self, refs: list[LoRARef] = ()) -> None:
        self._cond = threading.Condition()
        self._refs: dict[str, LoRARef] = {r.lora_name: r for r in refs}
        self._loading: set[str] = set()  # names whose load is under way
        self._unloading: set[str] = set()  # names whose unload is under way
        self._in_flight: dict[str, int] = {}  # lora_id -> requests submitted and not forgotten

    @property
    def names(self) -> list[str]:
        with self._cond:
            return sorted(self._refs)

    def get(self, name: str) -> LoRARef | None:
        with self._cond:
            return self._refs.get(name)

    def acquire(self, name: str) -> LoRARef:
        """Count one more request on adapter ``name``; ValueError if no adapter has that name."""
        with self._cond:
            ref = self._refs.get(name)
            if ref is None:
                loaded = ", ".join(sorted(self._refs)) or "none"
                raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {loaded}")
            self._in_flight[ref.lora_id] = self._in_flight.get(ref.lora_id, 0) + 1
            return ref

    def release(self, lora_id: str) -> None:
        with self._cond:
            left = self._in_flight.get(lora_id, 0) - 1
            if left < 0:
                raise RuntimeError(f"LoRA adapter {lora_id} released more often than acquired")
            if left:
                self._in_flight[lora_id] = left
            else:
                self._in_flight.pop(lora_id, None)
                self._cond.notify_all()

    def in_flight(self, lora_id: str) -> int:
        with self._cond:
            return self._in_flight.get(lora_id, 0)

    def begin_load(self, name: str, path: str, pinned: bool) -> LoRARef:
        """Reserve ``name`` for a new reference (ValueError if it is taken or being loaded)."""
        with self._cond:
            if name in self._refs or name in self._loading:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            self._loading.add(name)
            return LoRARef(name, path, bool(pinned))

    def end_load(self, ref: LoRARef, ok: bool) -> None:
        with self._cond:
            self._loading.discard(ref.lora_name)
            if ok:
                self._refs[ref.lora_name] = ref

    def begin_unload(self, name: str) -> LoRARef:
        """Take the name away (new requests for it are refused from now on); its reference."""
        with self._cond:
            ref = self._refs.pop(name, None)
            if ref is None:
                loaded = ", ".join(sorted(self._refs)) or "none"
                raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {loaded}")
            self._unloading.add(name)
            return ref

    def end_unload(self, ref: LoRARef, ok: bool) -> None:
        """The unload's outcome: a refused one gives the name back."""
        with self._cond:
            self._unloading.discard(ref.lora_name)
            if not ok:
                self._refs.setdefault(ref.lora_name, ref)

    def sync(self, refs: tuple[LoRARef, ...]) -> None:
        """Follow the scheduler's adapters (with several front ends, another front end may
        have loaded or unloaded one): a name whose load or unload this front end has under
        way stays as it is."""
        with self._cond:
            busy = self._loading | self._unloading
            ids = {r.lora_id for r in refs}
            for name, ref in list(self._refs.items()):
                if ref.lora_id not in ids and name not in busy:
                    del self._refs[name]
            for ref in refs:
                if ref.lora_name not in busy:
                    self._refs.setdefault(ref.lora_name, ref)

    def wait_idle(self, lora_id: str, check_alive, poll_s: float = 1.0) -> None:
        """Block until no request in flight uses ``lora_id``, calling ``check_alive`` (which
        raises when the engine died) every ``poll_s`` seconds."""
        with self._cond:
            while self._in_flight.get(lora_id, 0):
                self._cond.wait(poll_s)
                check_alive()
