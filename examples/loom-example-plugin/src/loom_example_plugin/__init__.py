"""An example out-of-tree Loom plug-in package.

Loom calls :func:`register` once per process (through the ``loom.plugins`` entry point declared in
this package's ``pyproject.toml``). Registering uses lazy ``"module:Class"`` strings, so it imports
neither torch nor the modules below; Loom imports a member only when someone resolves its name.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from loom.plugins import register

    register(
        "radix_eviction_policy",
        "example_lfu_then_lru",
        "loom_example_plugin.eviction:LFUThenLRUPolicy",
    )
    register("model", "OlmoForCausalLM", "loom_example_plugin.olmo:OlmoForCausalLM")
    register(
        "logits_processor",
        "example_force_token",
        "loom_example_plugin.logits:ForceTokenProcessor",
    )
