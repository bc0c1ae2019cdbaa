"""Conformance kits: one function per plug-in family that checks a member against its contract.

Plug-in authors call them from their own tests, e.g.::

    from loom.testing import check_radix_eviction_policy
    def test_my_policy():
        check_radix_eviction_policy("my_policy")

Loom's own tests run every kit over every registered name. Each kit raises AssertionError with a
message naming the broken rule.
"""

from __future__ import annotations

from loom.testing.kits import (
    check_attention_backend,
    check_grammar_backend,
    check_hicache_storage,
    check_logits_processor,
    check_lora_eviction_policy,
    check_radix_eviction_policy,
    check_schedule_policy,
)

__all__ = [
    "check_attention_backend",
    "check_grammar_backend",
    "check_hicache_storage",
    "check_logits_processor",
    "check_lora_eviction_policy",
    "check_radix_eviction_policy",
    "check_schedule_policy",
]
