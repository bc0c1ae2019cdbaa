"""Every registered member of each family passes its conformance kit (built-ins and plug-ins)."""

from __future__ import annotations

import pytest
import torch

from loom import plugins
from loom.testing import (
    TINY_ARCHITECTURES,
    check_attention_backend,
    check_logits_processor,
    check_lora_eviction_policy,
    check_model,
    check_model_engine,
    check_model_loader,
    check_radix_eviction_policy,
    check_schedule_policy,
    tiny_config,
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


# sliding windows and logit soft caps (the kit's sequences run to 65 tokens, its cached
# prefixes to 40): a window inside the prefixes, one past every sequence, a cap alone, both
_WINDOW_AND_CAP = {
    "window-8": dict(sliding_window=8),
    "window-100": dict(sliding_window=100),
    "cap": dict(logit_cap=2.0),
    "window-8-cap": dict(sliding_window=8, logit_cap=2.0),
}


@pytest.mark.parametrize("case", list(_WINDOW_AND_CAP))
@pytest.mark.parametrize("name", _available("attention_backend"))
def test_attention_backend_kit_with_window_and_cap(name, case):
    """Every backend declaring sliding windows / logit caps in ``features`` passes the kit with
    them (on CPU: torch_native, and Triton's kernels under the interpreter)."""
    cls = plugins.resolve("attention_backend", name)
    if not cls.is_supported(torch.device("cpu")):
        pytest.skip(f"{name} does not run on CPU")
    kw = _WINDOW_AND_CAP[case]
    needs = set(kw)  # the keywords are the features' names
    if not needs <= cls.features:
        pytest.skip(f"{name} does not declare {sorted(needs - cls.features)}")
    check_attention_backend(name, page_size=4, **kw)


def test_a_backend_without_a_feature_is_refused():
    """A backend whose ``features`` lack what the model's layers use raises ValueError from its
    constructor (so ``--attention-backend auto`` takes the next one)."""
    from loom.layers.attention.torch_native import TorchNativeAttnBackend

    class Plain(TorchNativeAttnBackend):
        features = frozenset()

    plugins.register("attention_backend", "plain_for_test", Plain)
    try:
        with pytest.raises(ValueError, match="sliding_window"):
            check_attention_backend("plain_for_test", sliding_window=8)
    finally:
        plugins.unregister("attention_backend", "plain_for_test")


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["torch_native", "triton", "flash_attention"])
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
    for kw in _WINDOW_AND_CAP.values():
        if set(kw) <= cls.features:
            check_attention_backend(
                name, device="cuda", dtype=torch.bfloat16, page_size=16, head_dim=64, **kw
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


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", _available("model"))
def test_model_kit(name, tie):
    if name not in TINY_ARCHITECTURES:  # an out-of-tree member brings its own config
        pytest.skip(f"{name} needs its own config")
    check_model(name, hf_config=tiny_config(name, tie_word_embeddings=tie))


@pytest.mark.parametrize("name", sorted(TINY_ARCHITECTURES))
def test_model_engine_kit(name):
    """Greedy tokens through the engine equal HF's: alone, batched, chunked and retracted, on
    prompts longer than the tiny configs' sliding windows, with soft-caps binding."""
    check_model_engine(tiny_config(name), model_impl="loom")


def _loader_kit_args(name, request):
    if name == "dummy":  # random weights: no oracle
        return {"reference": None}
    if name == "pt":  # the kit's tiny Llama with its weights as a PyTorch pickle
        from safetensors.torch import load_file

        from loom.testing._common import save_tiny_llama as kit_tiny_llama
        from loom.testing._common import tiny_llama_config

        path = request.getfixturevalue("tmp_path") / "pt"
        kit_tiny_llama(str(path), tiny_llama_config(), 0)
        st = path / "model.safetensors"
        torch.save(load_file(st), path / "pytorch_model.bin")
        st.unlink()
        return {"path": str(path)}
    if name == "gguf":  # SmolLM2's GGUF against transformers' own load of it
        return {
            "path": request.getfixturevalue("smol_gguf"),
            "reference": request.getfixturevalue("hf_model"),
        }
    return {}


@pytest.mark.parametrize("name", _available("model_loader"))
def test_model_loader_kit(name, request):
    check_model_loader(name, **_loader_kit_args(name, request))


def test_kit_catches_a_wrong_attention_backend():
    from loom.layers.attention.torch_native import TorchNativeAttnBackend

    class Wrong(TorchNativeAttnBackend):  # forgets the cached prefix in extend
        def forward_extend(self, q, layer, batch):
            for item in batch.attn_metadata.extend:
                item.kv_indices = item.kv_indices[-item.q_len :]
                item.prefix_len = 0
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


def _llama():
    from loom.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def test_model_kit_catches_a_model_that_skips_a_layer_in_load_weights():
    from loom.model_loader.weight_utils import load_packed_weights

    class SkipsALayer(_llama()):  # drops layer 1's weights and claims it loaded everything
        def load_weights(self, weights):
            weights = ((n, w) for n, w in weights if ".layers.1." not in n)
            load_packed_weights(self, weights, self.packed_modules_mapping, ["rotary_emb"])
            return {n for n, _ in self.named_parameters()}

    with pytest.raises(AssertionError, match=r"never wrote \['model\.layers\.1\."):
        check_model(SkipsALayer, reference="auto")


def test_model_kit_catches_a_wrong_kv_cache_shape():
    class AllHeads(_llama()):  # sizes the KV cache for every query head, not the KV heads
        @classmethod
        def kv_cache_shape(cls, config):
            layers, _, head_dim = super().kv_cache_shape(config)
            return layers, config.num_attention_heads, head_dim

    with pytest.raises(AssertionError, match="kv_cache_shape"):
        check_model(AllHeads)


def test_model_kit_catches_a_model_that_ignores_logit_indices():
    class LastOnly(_llama()):  # always returns each request's last token (no prompt logprobs)
        def forward(self, input_ids, positions, batch):
            batch.logit_indices = None
            return super().forward(input_ids, positions, batch)

    with pytest.raises(AssertionError, match="logit_indices.*shape"):
        check_model(LastOnly)


def test_model_kit_catches_wrong_logits():
    class NoRope(_llama()):  # attends without rotary positions
        def forward(self, input_ids, positions, batch):
            return super().forward(input_ids, torch.zeros_like(positions), batch)

    with pytest.raises(AssertionError, match="off by"):
        check_model(NoRope)


def _safetensors_loader():
    from loom.model_loader.loaders import SafetensorsLoader

    return SafetensorsLoader


def test_model_loader_kit_catches_a_loader_that_leaves_a_parameter_unwritten():
    from loom.model_loader.base import build_model, process_weights_after_loading
    from loom.model_loader.weight_utils import load_packed_weights

    class Forgetful(_safetensors_loader()):  # never loads one layer's down_proj
        def load_model(self, model_config, device_config):
            model = build_model(model_config, device_config)
            weights = (
                (n, w)
                for n, w in self.iterate_weights(model_config.path)
                if n != "model.layers.1.mlp.down_proj.weight"
            )
            load_packed_weights(model, weights, model.packed_modules_mapping, ["rotary_emb"])
            return process_weights_after_loading(model)

    with pytest.raises(AssertionError, match=r"never wrote \['model\.layers\.1\.mlp\.down_proj"):
        check_model_loader(Forgetful)


def test_model_loader_kit_catches_wrong_weights():
    class Scaled(_safetensors_loader()):  # a conversion bug: one tensor comes out scaled
        def iterate_weights(self, path):
            for n, w in super().iterate_weights(path):
                yield n, (w * 2 if n == "model.layers.0.self_attn.v_proj.weight" else w)

    with pytest.raises(AssertionError, match="off by"):
        check_model_loader(Scaled)


def test_model_loader_kit_catches_a_wrong_dtype_and_a_training_model():
    class Fp32Always(_safetensors_loader()):  # ignores model_config.dtype
        def load_model(self, model_config, device_config):
            import dataclasses

            fp32 = dataclasses.replace(model_config, dtype=torch.float32)
            return super().load_model(fp32, device_config)

    with pytest.raises(AssertionError, match=r"torch\.bfloat16.*is torch\.float32"):
        check_model_loader(Fp32Always)

    class Training(_safetensors_loader()):
        def load_model(self, model_config, device_config):
            return super().load_model(model_config, device_config).train()

    with pytest.raises(AssertionError, match="eval"):
        check_model_loader(Training)


def test_model_loader_kit_catches_a_config_without_architectures():
    class NoArchitectures(_safetensors_loader()):
        def load_hf_config(self, path):
            config = super().load_hf_config(path)
            config.architectures = None
            return config

    with pytest.raises(AssertionError, match="architectures"):
        check_model_loader(NoArchitectures)
