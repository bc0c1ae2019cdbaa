"""Every registered member of each family passes its conformance kit (built-ins and plug-ins)."""

from __future__ import annotations

import pytest
import torch

from loom import plugins
from loom.testing import (
    check_attention_backend,
    check_logits_processor,
    check_lora_eviction_policy,
    check_radix_eviction_policy,
    check_schedule_policy,
)


def _available(family: str) -> list[str]:
    return [e.name for e in plugins.entries(family) if plugins.is_available(e)[0]]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", _available("attention_backend"))
def test_attention_backend_kit(name, page_size):
    cls = plugins.resolve("attention_backend", name)
    if not cls.is_supported(torch.device("cpu")):
        pytest.skip(f"{name} does not run on CPU")
    check_attention_backend(name, page_size=page_size)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["torch_native", "triton"])
def test_attention_backends_read_an_fp8_kv_cache(name, kv_dtype):
    """--kv-cache-dtype fp8_*: the backends read the fp8 pool exactly (the reference attends to
    the same rounded K/V)."""
    cls = plugins.resolve("attention_backend", name)
    if not cls.is_supported(torch.device("cpu")):
        pytest.skip(f"{name} does not run on CPU")
    check_attention_backend(name, page_size=4, kv_dtype=kv_dtype)
    if name == "triton":  # half-precision models take the tl.dot decode
        check_attention_backend(name, dtype=torch.float16, page_size=4, kv_dtype=kv_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", _available("attention_backend"))
def test_attention_backend_kit_cuda(name):
    cls = plugins.resolve("attention_backend", name)
    if not cls.is_supported(torch.device("cuda")):
        pytest.skip(f"{name} is not supported here")
    if cls.supports_dtype(torch.float32):
        check_attention_backend(name, device="cuda", dtype=torch.float32)
    check_attention_backend(name, device="cuda", dtype=torch.bfloat16, page_size=16, head_dim=64)
    if name != "flashinfer":  # it reads a cache of the model's dtype only
        check_attention_backend(
            name, device="cuda", dtype=torch.bfloat16, head_dim=64, kv_dtype=torch.float8_e4m3fn
        )


@pytest.mark.parametrize("name", _available("schedule_policy"))
def test_schedule_policy_kit(name):
    check_schedule_policy(name)


@pytest.mark.parametrize("name", _available("radix_eviction_policy"))
def test_radix_eviction_policy_kit(name):
    check_radix_eviction_policy(name)


@pytest.mark.parametrize("name", _available("lora_eviction_policy"))
def test_lora_eviction_policy_kit(name):
    check_lora_eviction_policy(name)


@pytest.mark.parametrize("name", _available("logits_processor"))
def test_logits_processor_kit(name):
    check_logits_processor(name)


def test_kit_catches_a_wrong_attention_backend():
    from loom.layers.attention.torch_native import TorchNativeAttnBackend

    class Wrong(TorchNativeAttnBackend):  # forgets the cached prefix in extend
        def forward_extend(self, q, layer, batch):
            for item in batch.attn_metadata.extend:
                item.kv_indices = item.kv_indices[-item.q_len :]
                item.mask = None
            return super().forward_extend(q, layer, batch)

    plugins.register("attention_backend", "wrong_for_test", Wrong)
    try:
        with pytest.raises(AssertionError, match="extend"):
            check_attention_backend("wrong_for_test")
    finally:
        plugins.unregister("attention_backend", "wrong_for_test")


def test_kit_catches_a_lossy_schedule_policy():
    from loom.scheduler.policy import SchedulePolicy

    class Lossy(SchedulePolicy):
        def order(self, waiting, cache):
            return waiting[1:]

    plugins.register("schedule_policy", "lossy_for_test", Lossy)
    try:
        with pytest.raises(AssertionError, match="permutation"):
            check_schedule_policy("lossy_for_test")
    finally:
        plugins.unregister("schedule_policy", "lossy_for_test")
