"""Conformance kits: one function per plug-in family that checks a member against its contract.

Plug-in authors call them from their own tests, e.g.::

    from loom.testing import check_radix_eviction_policy
    def test_my_policy():
        check_radix_eviction_policy("my_policy")

Loom's own tests run every kit over every registered name. Each kit raises AssertionError with a
message naming the broken rule. One module per family: ``loom.testing.<family>``.
"""

from __future__ import annotations

from loom.testing.attention_backend import check_attention_backend
from loom.testing.grammar_backend import check_grammar_backend
from loom.testing.hicache_storage import check_hicache_storage
from loom.testing.logits_processor import check_logits_processor
from loom.testing.lora_eviction_policy import check_lora_eviction_policy
from loom.testing.model import TINY_ARCHITECTURES, check_model, check_model_engine, tiny_config
from loom.testing.model_loader import check_model_loader
from loom.testing.quantization import check_quantization
from loom.testing.radix_eviction_policy import check_radix_eviction_policy
from loom.testing.schedule_policy import check_schedule_policy
from loom.testing.tool_call_parser import check_tool_call_parser

__all__ = [
    "TINY_ARCHITECTURES",
    "check_attention_backend",
    "check_grammar_backend",
    "check_hicache_storage",
    "check_logits_processor",
    "check_lora_eviction_policy",
    "check_model",
    "check_model_engine",
    "check_model_loader",
    "check_quantization",
    "check_radix_eviction_policy",
    "check_schedule_policy",
    "check_tool_call_parser",
    "tiny_config",
]
