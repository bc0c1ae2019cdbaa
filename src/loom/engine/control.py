"""The engine's control calls: messages to the scheduler answered one by one (adapters loaded
and unloaded, weights swapped), each waited for and its error raised here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loom.scheduler.messages import LoadLoRA, UnloadLoRA, UpdateWeights


class ControlCalls:
    """Mixed into ``Engine``: uses its ``router``, ``backend``, ``info``, ``lora_registry`` and
    ``_check_alive``."""

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Load a PEFT adapter from ``path`` under ``name``; requests may use it once this
        returns. ``pinned``: it keeps its device slot for good. The checkpoint is read on the
        scheduler's loader thread, so the running requests go on meanwhile. Raises ValueError
        naming the problem (unknown path, unsupported adapter, a rank or module outside the
        pool's, a name in use, too many pinned)."""
        registry = self._lora_on()
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError("load_lora_adapter takes a non-empty lora_name and lora_path")
        if not isinstance(pinned, bool):
            raise ValueError(f"pinned must be true or false, got {pinned!r}")
        ref = registry.begin_load(name, path, pinned)
        ok = False
        try:
            self._control_call(lambda rid: LoadLoRA(rid, ref))
            ok = True
        finally:
            registry.end_load(ref, ok)

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name``: new requests for it are refused at once; the call returns
        when the requests already sent with it have ended and the scheduler has dropped it.
        With several front ends, the scheduler refuses it (ValueError) while requests from the
        others run on it."""
        registry = self._lora_on()
        ref = registry.begin_unload(name)
        ok = False
        try:
            registry.wait_idle(ref.lora_id, self._check_alive)
            self._control_call(lambda rid: UnloadLoRA(rid, ref.lora_id, name))
            ok = True
        finally:
            registry.end_unload(ref, ok)

    def _lora_on(self):
        if self.lora_registry is None:
            raise ValueError("LoRA is off: start the engine with --enable-lora or --lora-paths")
        return self.lora_registry

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, abort_all_requests: bool = False
    ) -> tuple[bool, str, int]:
        """Swap the model's weights for the checkpoint at ``model_path`` (same architecture and
        shapes) between two steps, as SGLang's: the running requests are paused and go on with
        the new weights, or aborted with ``abort_all_requests``; the prefix cache is emptied.
        Returns (success, message, number of paused requests); on failure the old weights keep
        serving."""
        from loom.model_loader.model_path import resolve_model_path

        if not isinstance(model_path, str) or not model_path:
            raise ValueError("update_weights_from_disk takes a non-empty model_path")
        try:
            path = resolve_model_path(model_path)
            out = self._control_call(
                lambda rid: UpdateWeights(rid, path, load_format, bool(abort_all_requests))
            )
        except (ValueError, OSError) as e:
            return False, str(e), 0
        self.model_path = self.info["model_path"] = path
        paused = out.finished_reason.get("num_paused_requests", 0)
        return True, f"weights updated from {path}", paused

    def _control_call(self, message: Callable[[str], Any]) -> Any:
        """Send a control message to the scheduler and wait for its reply (returned); its
        error, if any, raised as a ValueError."""
        self._check_alive()
        out = self.router.call(self.backend.send, self._check_alive, message)
        if out.error is not None:
            raise ValueError(out.error)
        return out
