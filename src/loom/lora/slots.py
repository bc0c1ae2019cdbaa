"""The scheduler's side of multi-LoRA: which adapter a request names, the device slot it holds
while it runs, and loading or unloading adapters while serving.

A request is duck-typed: ``rid``, ``lora_id`` (the adapter's reference id; None: the base
model), ``lora_name`` (for messages), ``extra_key`` (the prefix-cache namespace, set here) and
``lora_slot`` (-1 while it holds none).
"""

from __future__ import annotations

_OFF = "LoRA is off: start the engine with --enable-lora or --lora-paths"


class LoRAUnavailable(Exception):
    """The request's adapter could not be brought back from disk."""


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
        if req.lora_id is None:
            return None
        if self.manager is None:
            return "LoRA adapters are not enabled (--lora-paths)"
        if not self.manager.has(req.lora_id):
            return self._unknown(req.lora_name)
        req.extra_key = self.manager.cache_namespace(req.lora_id, req.extra_key)
        return None

    def acquire(self, req) -> str:
        """A slot for the request's adapter: ``"ready"`` (it holds the slot now), ``"loading"``
        (its adapter is on its way: skip it this step) or ``"busy"`` (every slot is held by
        adapters in use). Raises ``LoRAUnavailable`` when the adapter cannot be read again."""
        try:
            state = self.manager.acquire(req.lora_id)
        except ValueError as e:
            raise LoRAUnavailable(str(e)) from None
        if state == "ready":
            req.lora_slot = self.manager.slot_of(req.lora_id)
        return state

    def release(self, req) -> None:
        if req.lora_slot >= 0:
            self.manager.release(req.lora_id)
            req.lora_slot = -1

    def start_load(self, ref, message_id: str) -> str | None:
        """Begin loading an adapter while serving (answered through ``poll``); the error
        message if it cannot start, or None."""
        if self.manager is None:
            return _OFF
        return self.manager.start_load(ref, message_id)

    @property
    def loading(self) -> bool:
        """Whether adapters are being read from disk."""
        return self.manager is not None and self.manager.loader.busy

    def poll(self) -> list[tuple[str, str | None]]:
        """Finished loads: (message id, error or None)."""
        return [] if self.manager is None else self.manager.poll()

    def unload(self, lora_id: str, name: str, users: list[str]) -> str | None:
        """Unload an adapter that none of ``users`` (the ids of the requests naming it) still
        needs; the error message, or None."""
        if self.manager is None:
            return _OFF
        if not self.manager.has(lora_id):
            return self._unknown(name)
        if users:
            return f"LoRA adapter {name!r} is in use by {len(users)} request(s)"
        self.manager.remove(lora_id)
        return None

    def check_balance(self, owners) -> None:
        """Each adapter's slot is held by exactly the requests counted for it."""
        if self.manager is None:
            return
        held: dict[str, int] = {}
        for r in owners:
            if r.lora_slot >= 0:
                held[r.lora_id] = held.get(r.lora_id, 0) + 1
                if self.manager.slot_ids[r.lora_slot] != r.lora_id:
                    raise AssertionError(
                        f"request {r.rid} holds slot {r.lora_slot} of another adapter"
                    )
        refs = {n: c for n, c in self.manager.refs.items() if c}
        if held != refs:
            raise AssertionError(f"LoRA slots do not balance: held {held}, counted {refs}")

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
