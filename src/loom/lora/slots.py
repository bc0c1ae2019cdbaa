"""The scheduler's side of multi-LoRA: which adapter a request names, the device slot it holds
while it runs, and loading or unloading adapters while serving.

A request is duck-typed: ``rid``, ``lora_name``, ``extra_key`` (the prefix-cache namespace,
set here) and ``lora_slot`` (-1 while it holds none).
"""

from __future__ import annotations

_OFF = "LoRA is off: start the engine with --enable-lora or --lora-paths"


class LoRASlots:
    """``manager``: the model runner's ``LoRAManager``, or None when LoRA is off."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def _unknown(self, name: str) -> str:
        loaded = ", ".join(self.manager.names) or "none"
        return f"unknown LoRA adapter {name!r}; loaded: {loaded}"

    def check(self, req) -> str | None:
        """Why the request cannot be served (its adapter is unknown, or LoRA is off), or None;
        a request with an adapter gets its own prefix-cache namespace."""
        if req.lora_name is None:
            return None
        if self.manager is None:
            return "LoRA adapters are not enabled (--lora-paths)"
        if not self.manager.has(req.lora_name):
            return self._unknown(req.lora_name)
        req.extra_key = self.manager.cache_namespace(req.lora_name, req.extra_key)
        return None

    def acquire(self, req) -> bool:
        """A slot for the request's adapter; False while every slot is busy with others."""
        if not self.manager.acquire(req.lora_name):
            return False
        req.lora_slot = self.manager.slot_of(req.lora_name)
        return True

    def release(self, req) -> None:
        if req.lora_slot >= 0:
            self.manager.release(req.lora_name)
            req.lora_slot = -1

    def load(self, name: str, path: str) -> str | None:
        """Load an adapter while serving; the error message, or None."""
        if self.manager is None:
            return _OFF
        try:
            self.manager.add(name, path)
        except (ValueError, OSError) as e:
            return str(e)
        return None

    def unload(self, name: str, users: list[str]) -> str | None:
        """Unload an adapter that none of ``users`` (the ids of the requests naming it) still
        needs; the error message, or None."""
        if self.manager is None:
            return _OFF
        if not self.manager.has(name):
            return self._unknown(name)
        if users:
            return (
                f"LoRA adapter {name!r} is in use by {len(users)} request(s); retry when they end"
            )
        self.manager.remove(name)
        return None

    def check_balance(self, owners) -> None:
        """Each adapter's slot is held by exactly the requests counted for it."""
        if self.manager is None:
            return
        held: dict[str, int] = {}
        for r in owners:
            if r.lora_slot >= 0:
                held[r.lora_name] = held.get(r.lora_name, 0) + 1
                if self.manager.slot_names[r.lora_slot] != r.lora_name:
                    raise AssertionError(
                        f"request {r.rid} holds slot {r.lora_slot} of another adapter"
                    )
        refs = {n: c for n, c in self.manager.refs.items() if c}
        if held != refs:
            raise AssertionError(f"LoRA slots do not balance: held {held}, counted {refs}")
