"""Multi-LoRA on the GPU: a batch mixing two peft adapters and the base model, with CUDA graphs
on, gives peft's greedy tokens (peft on CPU in fp32), with either LoRA backend: Triton's decode
steps with adapters replay the graphs (each row's slot a graph input), torch_native's run
eagerly. Skipped without CUDA."""

from __future__ import annotations

import pytest

import loom
from tests.test_lora import GREEDY, PROMPTS, lora_setup, peft_ref  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lora_backend", ["triton", "torch_native"])
@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_cuda_mixed_lora_batch_matches_peft(lora_setup, peft_ref, backend, lora_backend):  # noqa: F811
    base, paths = lora_setup
    jobs = [(p, lo) for p in PROMPTS for lo in ("a", "b", None)]
    with loom.Engine(
        model=base,
        device="cuda",
        dtype="float32",
        skip_tokenizer_init=True,
        max_total_tokens=4096,
        attention_backend=backend,
        lora_backend=lora_backend,
        lora_paths=[f"{n}={p}" for n, p in paths.items()],
    ) as e:
        graphs = e.runner.cuda_graph_runner  # (torch_native attention captures none)
        assert (graphs is not None) == (backend == "triton")
        if graphs is not None:
            assert (graphs.lora is not None) == (lora_backend == "triton")
        outs = e.generate(
            input_ids=[p for p, _ in jobs], sampling_params=GREEDY, lora_path=[lo for _, lo in jobs]
        )
        # the base model alone after the adapters: its decode steps replay CUDA graphs
        plain = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        e.scheduler.check_kv_balance()
    for (p, lo), o in zip(jobs, outs, strict=True):
        assert o["output_ids"] == peft_ref(lo, p)[0], (p, lo)
    assert [o["output_ids"] for o in plain] == [peft_ref(None, p)[0] for p in PROMPTS]
