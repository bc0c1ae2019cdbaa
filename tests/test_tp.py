"""Tensor parallelism on the CPU over gloo: ``--tp-size 2`` runs a second process on this machine,
and its greedy tokens must equal ``--tp-size 1``'s (the oracle: TP 1 is compared with HF
elsewhere) for SmolLM2 from its GGUF (9 query and 3 KV heads: an uneven split), tiny Qwen3,
Mixtral and Qwen3-MoE, through chunked prefill, retraction and the prefix cache. A killed rank
stops the server with an error naming it, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    prompts = [
        [(17 * i + 5 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((3, 40, 9, 25))
    ]
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


def test_a_start_that_fails_after_the_ranks_met_leaves_no_group_behind(monkeypatch):
    import torch.distributed as dist

    from loom.distributed import get_tp_size
    from loom.scheduler import scheduler

    def refuse(*args, **kwargs):
        raise RuntimeError("refused after the model was built")

    monkeypatch.setattr(scheduler.Scheduler, "__init__", refuse)
    with pytest.raises(RuntimeError, match="refused after the model was built"):
        loom.Engine(skip_tokenizer_init=True, tp_size=2, max_total_tokens=512)
    assert not dist.is_initialized() and get_tp_size() == 1
    monkeypatch.undo()
    (outs,), _, _ = _generate(2, [[1, 2, 3]], max_total_tokens=512)  # a new group forms
    assert len(outs[0]) == GREEDY["max_new_tokens"]


def test_a_killed_rank_stops_the_server_naming_it():
    e = loom.Engine(skip_tokenizer_init=True, tp_size=2, max_total_tokens=512)
    try:
        leader = e.scheduler.runner.tp_leader
        ((rank, proc),) = leader.procs.items()
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


def test_smollm2_with_lora_adapters_tp2_matches_tp1(hf_ref_dir, tmp_path):
    """PEFT adapters on SmolLM2 (its 9 query heads split 6 + 3: the uneven q / k / v rows and
    o_proj columns), one given at start and pinned, two loaded while serving, one unloaded; one
    device slot beside the pinned one and a host tier of one, so the slot is rewritten and
    adapters are read again from disk while the batch runs. Each request's tokens equal TP 1's."""
    from tests.test_lora import _make_adapter

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = _make_adapter(hf_ref_dir, str(tmp_path / "a"), 1, r=8, lora_alpha=16, target_modules=every)
    b = _make_adapter(
        hf_ref_dir, str(tmp_path / "b"), 2, r=4, lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
    )  # fmt: skip
    c = _make_adapter(
        hf_ref_dir, str(tmp_path / "c"), 3, r=8, lora_alpha=8, target_modules=["k_proj", "up_proj"]
    )
    prompts = [
        [(13 * i + 7 * j) % 3000 + 20 for j in range(n)] for i, n in enumerate((5, 17, 9, 12))
    ]
    picks = [["b", "c", None, "b"], ["c", "b", "c", None]]

    def run(tp: int):
        pinned = f'{{"lora_name": "a", "lora_path": "{a}", "pinned": true}}'
        with loom.Engine(
            skip_tokenizer_init=True,
            tp_size=tp,
            lora_paths=(pinned,),
            max_loras_per_batch=2,
            max_loaded_loras=1,
            max_lora_rank=8,
            lora_target_modules=("all",),
            max_total_tokens=512,
        ) as e:
            outs = [e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="a")]
            e.load_lora_adapter("b", b)
            e.load_lora_adapter("c", c)
            for lora in picks:  # two adapters for one free slot
                outs.append(e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora))
            e.unload_lora_adapter("b")
            outs.append(e.generate(input_ids=prompts, sampling_params=GREEDY, lora_path="c"))
            outs.append(e.generate(input_ids=prompts, sampling_params=GREEDY))
            manager = e.scheduler.runner.lora_manager
            loads, reads = manager.num_slot_loads, manager.loader.num_disk_reads
            e.scheduler.check_kv_balance()
        return [[o["output_ids"] for o in out] for out in outs], loads, reads

    one, loads_one, reads_one = run(1)
    two, loads_two, reads_two = run(2)
    assert two == one
    assert loads_two == loads_one and loads_one >= 4  # slots were written again while serving
    assert reads_two == reads_one and reads_one >= 4  # and an adapter came back from disk
    base = one[-1]
    assert (
        one[0] != base and one[1][0] != base[0] and one[1][1] != base[1]
    )  # adapters change tokens


def _prompt_logprobs(tp: int, prompts, **kw) -> torch.Tensor:
    """The log-probability of each prompt token after the ones before it, every prompt."""
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    with loom.Engine(skip_tokenizer_init=True, tp_size=tp, max_total_tokens=512, **kw) as e:
        out = e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True,
                         logprob_start_len=0)  # fmt: skip
    return torch.tensor([lp for o in out for lp, *_ in o["meta_info"]["input_token_logprobs"][1:]])


def test_smollm2_gguf_blocks_kept_tp2_matches_tp1():
    """``--quantization gguf`` keeps SmolLM2's Q4_1 projections in their blocks; each rank loads
    its rows, and o_proj / down_proj their input columns as whole blocks of bytes. The int4
    kernel multiplies in bf16, and under TP each rank's partial sums are rounded to bf16 before
    the all-reduce, so greedy tokens of near-tied random prompts may differ: the bound is the
    bf16 path's own error. The prompt log-probabilities of TP 2 lie within twice TP 1's
    distance from the same weights in fp32 (the dense, dequantized file; measured: TP 2 within
    0.04 of TP 1, TP 1 within 0.05 of fp32)."""
    prompts = [[(11 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate((12, 40, 25))]
    fp32 = _prompt_logprobs(1, prompts)
    one = _prompt_logprobs(1, prompts, quantization="gguf")
    two = _prompt_logprobs(2, prompts, quantization="gguf")
    bf16_error = (one - fp32).abs().max().item()
    assert 0 < (two - one).abs().max().item() <= 2 * bf16_error
    assert bf16_error < 0.2


@pytest.fixture(scope="module")
def bnb_llama(tmp_path_factory):
    """A tiny Llama whose row-parallel inputs split on bitsandbytes' 64-weight blocks (o_proj:
    4 heads of 32, 64 a rank; down_proj 256), dense and as transformers saves it in NF4."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.conftest import save_tiny_llama

    root = tmp_path_factory.mktemp("tp-bnb")
    dense = save_tiny_llama(
        root / "dense", vocab_size=256, hidden_size=128, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.1,
    )  # fmt: skip
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    hf = AutoModelForCausalLM.from_pretrained(
        dense, quantization_config=config, device_map="cpu", dtype=torch.float32
    )
    hf.save_pretrained(root / "nf4")
    return dense, str(root / "nf4")


def test_bitsandbytes_tp2_matches_tp1(bnb_llama):
    """NF4 read from transformers' checkpoint (packed codes and per-block scales cut by
    column_cut) and NF4 quantized at load from the dense checkpoint (each rank quantizes its
    own rows and columns: the same blocks). bitsandbytes' CPU kernel multiplies in bf16 on this
    machine and each rank's partial sums round before the all-reduce: measured 0.027 at most
    between TP 2's and TP 1's prompt log-probabilities (mean 0.007), against 1.2 between the
    NF4 and the dense model. Bound: 0.1, and a tenth of the quantization's own effect, which a
    wrong cut of the codes or scales would be of the order of."""
    dense, nf4 = bnb_llama
    prompts = [[(7 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((12, 40, 25))]
    one = _prompt_logprobs(1, prompts, model=nf4)
    assert torch.equal(one, _prompt_logprobs(1, prompts, model=dense, quantization="bitsandbytes"))
    quant_effect = (one - _prompt_logprobs(1, prompts, model=dense)).abs().max().item()
    for kw in ({"model": nf4}, {"model": dense, "quantization": "bitsandbytes"}):
        diff = (_prompt_logprobs(2, prompts, **kw) - one).abs()
        assert diff.max().item() <= min(0.1, quant_effect / 10), kw
        assert diff.mean().item() <= 0.02, kw


@pytest.mark.parametrize(
    "kw", [{"quantization": "fp8"}, {"load_format": "layered"}, {"load_format": "pt"}]
)
def test_other_loaders_and_fp8_shard_on_load(bnb_llama, kw, tmp_path):
    """fp8 quantized at load (each rank's rows, per-channel scales), ``layered`` (each layer
    materialised at its shard's shape) and ``pt`` (a ``*.bin`` checkpoint): TP 2's prompt
    log-probabilities equal TP 1's up to fp32 summation order."""
    from tests.conftest import save_pt_copy

    dense, _ = bnb_llama
    model = save_pt_copy(dense, tmp_path / "pt") if kw.get("load_format") == "pt" else dense
    prompts = [[(7 * i + 5 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((12, 30))]
    one = _prompt_logprobs(1, prompts, model=model, **kw)
    two = _prompt_logprobs(2, prompts, model=model, **kw)
    torch.testing.assert_close(two, one, rtol=0, atol=1e-4)
    if "quantization" in kw:  # the fp8 weights are in use
        assert (one - _prompt_logprobs(1, prompts, model=model)).abs().max().item() > 1e-3


def test_tp_refuses_what_it_cannot_split_by_name(tmp_path):
    with pytest.raises(ValueError, match="--enable-hierarchical-cache"):
        loom.Engine(skip_tokenizer_init=True, tp_size=2, enable_hierarchical_cache=True)
    # o_proj's input (2 heads of 32 over 2 ranks) would split bitsandbytes' 64-weight blocks
    from tests.conftest import save_tiny_llama

    model = save_tiny_llama(tmp_path / "m", vocab_size=256)
    with pytest.raises(
        ValueError,
        match="input size 32 .this rank's share of 64 under --tp-size 2. is not a multiple of the block size 64",
    ):
        loom.Engine(model=model, skip_tokenizer_init=True, tp_size=2, quantization="bitsandbytes")


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.split("\n"):
        if line.strip():
            c, p = map(int, line.split())
            kids.setdefault(p, []).append(c)
    found, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def test_loom_serve_tp2_answers_the_openai_client():
    from openai import OpenAI

    from tests.test_server import MESSAGES, Server

    server = Server("--tp-size", "2")
    try:
        procs = _descendants(server.proc.pid)
        assert len(procs) >= 2  # the scheduler (rank 0) and rank 1
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        resp = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=MESSAGES, max_tokens=32, temperature=0
        )
        # the same answer as TP 1 gives (tests/test_server.py)
        assert resp.choices[0].message.content == "The capital of France is Paris."
    finally:
        rc = server.stop()
    assert rc in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
    time.sleep(0.5)
    assert not [p for p in procs if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _second_host(addr: str, *flags: str) -> subprocess.Popen:
    """``loom serve --node-rank 1`` as a second host would run it (on this machine)."""
    return subprocess.Popen(
        [sys.executable, "-m", "loom.cli", "serve", "--tp-size", "2", "--nnodes", "2",
         "--node-rank", "1", "--dist-init-addr", addr, "--skip-tokenizer-init", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_two_hosts_meet_at_dist_init_addr_and_must_agree():
    from tests.test_server import _free_port

    prompts = [[5, 6, 7, 8] * 4, [100, 200, 300]]
    (want,), _, _ = _generate(1, prompts, max_total_tokens=512)
    addr = f"127.0.0.1:{_free_port()}"
    host = _second_host(addr, "--max-total-tokens", "512")
    two = dict(nnodes=2, node_rank=0, dist_init_addr=addr, max_total_tokens=512)
    (got,), _, _ = _generate(2, prompts, **two)
    assert got == want
    rc = host.wait(timeout=30)
    assert rc == 0, f"the second host exited {rc}:\n{host.stdout.read()[-4000:]}"
    # a host started with other flags: both ends stop, naming what differs
    addr = f"127.0.0.1:{_free_port()}"
    host = _second_host(addr, "--max-total-tokens", "256")
    two["dist_init_addr"] = addr
    with pytest.raises(ValueError, match="rank 1: max_total_tokens"):
        loom.Engine(skip_tokenizer_init=True, tp_size=2, **two)
    assert host.wait(timeout=30) != 0


def test_each_rank_holds_about_half_the_weights():
    def weight_bytes(tp: int) -> int:
        with loom.Engine(skip_tokenizer_init=True, tp_size=tp, max_total_tokens=256) as e:
            model = e.scheduler.runner.model
            tensors = list(model.parameters()) + list(model.buffers())
            return sum(t.numel() * t.element_size() for t in tensors)

    one, two = weight_bytes(1), weight_bytes(2)
    # rank 0's shards: half of every split matrix, the norms and rotary tables whole, and the
    # (uneven) 6 of 9 query heads
    assert 0.45 * one < two < 0.6 * one, (one, two)


def test_a_hung_rank_stops_the_server_after_the_timeout():
    e = loom.Engine(skip_tokenizer_init=True, tp_size=2, max_total_tokens=512, dist_timeout=5)
    try:
        ((rank, proc),) = e.scheduler.runner.tp_leader.procs.items()
        e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="ranks 1..1 hung past --dist-timeout 5 s"):
            while time.monotonic() - start < 30:  # the first requests end aborted, then it raises
                e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert time.monotonic() - start < 30
    finally:
        e.shutdown()
    assert proc.wait(timeout=30) is not None  # killed, stopped as it was


def test_weight_updates_reach_every_rank_and_a_bad_one_leaves_them_serving(tmp_path):
    from transformers import AutoModelForCausalLM

    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path / f"m{seed}"
        AutoModelForCausalLM.from_config(tiny_config("Qwen3ForCausalLM")).save_pretrained(path)
        dirs.append(str(path))
    other = tiny_config("Qwen3ForCausalLM", intermediate_size=256)
    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "other")
    dirs.append(str(tmp_path / "other"))
    prompts = [[5, 9, 200, 31], [300, 2, 44, 90, 11, 8]]
    (want,), _, _ = _generate(1, prompts, model=dirs[1], max_total_tokens=1024)
    with loom.Engine(
        skip_tokenizer_init=True, tp_size=2, model=dirs[0], max_total_tokens=1024
    ) as e:
        ok, message, _ = e.update_weights_from_disk(str(tmp_path / "missing"))
        assert not ok and message
        # refused by the ranks themselves: the shapes differ
        ok, message, _ = e.update_weights_from_disk(dirs[2])
        assert not ok and "gate_up_proj" in message, message
        ok, message, _ = e.update_weights_from_disk(dirs[1])
        assert ok, message
        got = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == want  # both ranks serve the new weights


def test_column_cut_maps_input_cuts_to_whole_blocks():
    from loom.layers.quantization.base import column_cut

    q4k = column_cut(256, 144, "Q4_K")  # 256 weights in 144 bytes
    assert q4k(512, 256) == (288, 144)
    with pytest.raises(ValueError, match=r"\[384, 576\), inside Q4_K's blocks of 256 weights"):
        q4k(384, 192)  # SmolLM2's o_proj on rank 1 of 2: 3 heads of 64
    assert column_cut(32, 20, "Q4_1")(384, 192) == (240, 120)
