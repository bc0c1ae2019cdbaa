"""The ``cpu`` attention backend: decode by Loom's C++ kernel over the paged KV pool read in
place (``layers/attention/csrc/paged_decode.cpp``), the CPU's default for decode.

Oracles: dense attention in plain PyTorch (the family's conformance kit, which
``tests/test_conformance.py`` also runs on every backend), and ``torch_native`` (gathered K / V
through SDPA) on the same engine: greedy tokens equal."""

from __future__ import annotations

import pytest
import torch

import loom
from loom.layers.attention import cpu_backend
from loom.testing.attention_backend import check_attention_backend
from tests.conftest import save_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_backend.CPUAttnBackend.is_supported(torch.device("cpu")),
    reason=f"Loom's CPU attention kernel: {cpu_backend._build()}",
)

PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": torch.bfloat16},  # a bf16 KV pool, read as bf16
        {"head_dim": 24},  # a head size that is not a multiple of 16 lanes
        {"head_dim": 64, "page_size": 16, "sliding_window": 8, "logit_cap": 2.0},
    ],
)
def test_kit_beyond_the_default_shapes(kw):
    check_attention_backend("cpu", **kw)


def test_an_fp8_kv_cache_is_refused_and_auto_takes_torch_native():
    with pytest.raises(ValueError, match="float32 or bfloat16 KV cache"):
        check_attention_backend("cpu", kv_dtype=torch.float8_e4m3fn)
    with loom.Engine(skip_tokenizer_init=True, kv_cache_dtype="fp8_e4m3") as e:
        assert e.get_server_info()["attention_backend"] == "torch_native"


def test_default_model_decodes_as_torch_native(engine):
    """The default engine decodes with it; requests of different lengths together give the
    same greedy tokens as gathered K / V through SDPA."""
    assert engine.get_server_info()["attention_backend"] == "torch_native prefill + cpu decode"
    prompts = [[1] + list(range(20 + 7 * i, 20 + 7 * i + 5 + 9 * i)) for i in range(5)]
    want = engine.generate(input_ids=prompts, sampling_params=PARAMS)
    with loom.Engine(decode_attention_backend="torch_native", max_total_tokens=4096) as e:
        got = e.generate(input_ids=prompts, sampling_params=PARAMS)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_compiled_decode_step(tmp_path):
    """Traced whole by torch.compile (its fake implementation): the compiled step's tokens equal
    the eager step's on a tiny model, batch 1 and a batch of three."""
    tiny = save_tiny_llama(tmp_path / "tiny", seed=5)
    prompts = [[3, 9, 27, 81], [5, 25], [7, 49, 11, 13, 17, 19]]
    outs = []
    for compiled in (False, True):
        with loom.Engine(
            tiny, skip_tokenizer_init=True, enable_torch_compile=compiled, max_running_requests=4
        ) as e:
            assert "cpu decode" in e.get_server_info()["attention_backend"]
            outs.append(
                [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=PARAMS)]
                + [e.generate(input_ids=prompts[:1], sampling_params=PARAMS)[0]["output_ids"]]
            )
    assert outs[0] == outs[1]
