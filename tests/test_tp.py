"""Tensor parallelism on the CPU over gloo: ``--tp-size 2`` runs a second process on this machine,
and its greedy tokens must equal ``--tp-size 1``'s (the oracle: TP 1 is compared with HF
elsewhere) for SmolLM2 from its GGUF (9 query and 3 KV heads: an uneven split), tiny Qwen3,
Mixtral and Qwen3-MoE, through chunked prefill, retraction and the prefix cache. A killed rank
stops the server with an error naming it, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import loom
from loom.distributed import head_shard
from loom.testing.model import tiny_config

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}


def _generate(tp: int, prompts, rounds: int = 1, **kw):
    """Each round's tokens, whether the engine retracted, and the prompt tokens the last round
    found in the prefix cache; pages balance afterwards."""
    with loom.Engine(skip_tokenizer_init=True, tp_size=tp, **kw) as e:
        assert e.get_server_info()["tp_size"] == tp
        outs = []
        for _ in range(rounds):
            got = e.generate(input_ids=prompts, sampling_params=GREEDY)
            outs.append([o["output_ids"] for o in got])
        cached = sum(o["meta_info"]["cached_tokens"] for o in got)
        retracted = e.scheduler.stats.num_retractions > 0
        e.scheduler.check_kv_balance()
    return outs, retracted, cached


def test_head_shard_keeps_gqa_groups():
    # SmolLM2: 9 query heads in 3 groups over 2 ranks
    assert head_shard(9, 3, 0, 2) == head_shard(9, 3, 0, 2)
    a, b = head_shard(9, 3, 0, 2), head_shard(9, 3, 1, 2)
    assert (a.num_heads, a.q_start, a.num_kv_heads, a.kv_start) == (6, 0, 2, 0)
    assert (b.num_heads, b.q_start, b.num_kv_heads, b.kv_start) == (3, 6, 1, 2)
    # fewer KV heads than ranks: each replicated, its group's query heads split
    shards = [head_shard(8, 2, r, 4) for r in range(4)]
    assert [(s.num_heads, s.q_start, s.kv_start) for s in shards] == [
        (2, 0, 0),
        (2, 2, 0),
        (2, 4, 1),
        (2, 6, 1),
    ]
    # every query head exactly once, whatever the split
    for heads, kv, size in [(9, 3, 2), (32, 8, 3), (12, 4, 4), (16, 2, 8)]:
        covered = []
        for r in range(size):
            s = head_shard(heads, kv, r, size)
            covered += range(s.q_start, s.q_start + s.num_heads)
        assert sorted(covered) == list(range(heads))


def test_smollm2_gguf_tp2_matches_tp1_through_chunks_retraction_and_cache():
    prompts = [[(17 * i + 5 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((3, 40, 9, 25))]
    kw = {
        "max_total_tokens": 72,
        "chunked_prefill_size": 16,
        "schedule_conservativeness": 0.0,
    }
    one, retracted_one, cached_one = _generate(1, prompts, rounds=2, **kw)
    two, retracted_two, cached_two = _generate(2, prompts, rounds=2, **kw)
    assert two == one
    assert retracted_one and retracted_two  # the pool is too small for the batch at once
    assert cached_one > 0 and cached_two > 0  # the second round reuses the first's prompts


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_tiny_models_tp2_match_tp1(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(arch)).eval().save_pretrained(tmp_path)
    prompts = [[5, 9, 200, 31], [7] * 19, [300, 2, 44, 90, 11, 8]]
    one, _, _ = _generate(1, prompts, model=str(tmp_path), max_total_tokens=1024)
    two, _, _ = _generate(2, prompts, model=str(tmp_path), max_total_tokens=1024)
    assert two == one


def test_a_killed_rank_stops_the_server_naming_it():
    e = loom.Engine(skip_tokenizer_init=True, tp_size=2, max_total_tokens=512)
    try:
        leader = e.scheduler.runner.tp_leader
        (rank, proc), = leader.procs.items()
        e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"rank {rank}"):
            while time.monotonic() - start < 30:
                e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
                time.sleep(0.2)
        assert time.monotonic() - start < 30
    finally:
        e.shutdown()
    assert proc.poll() is not None


def test_tp_refuses_what_it_cannot_split_by_name():
    with pytest.raises(ValueError, match="--enable-lora"):
        loom.Engine(skip_tokenizer_init=True, tp_size=2, enable_lora=True, max_lora_rank=8)
