"""Adapter references, the host tier, pinning, target modules and the overlapped loader, against
peft's tokens on the tiny Llama of ``test_lora``."""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

import loom
from loom.lora.registry import LoRARef, LoRARegistry, parse_lora_paths
from tests.test_lora import (  # noqa: F401
    GREEDY,
    PROMPTS,
    _engine,
    _make_adapter,
    lora_setup,
    peft_ref,
)


@pytest.fixture(scope="module")
def third(lora_setup, tmp_path_factory):  # noqa: F811
    """A third adapter (q, k and up only) and peft's tokens for it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_lora import _greedy

    base, _ = lora_setup
    path = _make_adapter(
        base,
        str(tmp_path_factory.mktemp("lora3") / "c"),
        3,
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "k_proj", "up_proj"],
    )
    import torch

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(model, path).eval()
    with torch.inference_mode():
        ref = {tuple(p): _greedy(peft_model, torch.tensor([p]))[0] for p in PROMPTS}
    return path, ref


def test_lora_paths_forms():
    refs = parse_lora_paths(
        ["a=/x/a", "/y/b", json.dumps({"lora_name": "c", "lora_path": "/z", "pinned": True})]
    )
    assert [(r.lora_name, r.lora_path, r.pinned) for r in refs] == [
        ("a", "/x/a", False),
        ("b", "/y/b", False),
        ("c", "/z", True),
    ]
    # the same flag gives the same ids in every process; distinct adapters distinct ids
    assert [r.lora_id for r in parse_lora_paths(["a=/x/a"])] == [refs[0].lora_id]
    assert len({r.lora_id for r in refs}) == 3
    for bad, match in (
        (['{"lora_name": "c"}'], "needs string lora_name and lora_path"),
        (['{"lora_name": "c", "lora_path": "/z", "pin": true}'], "unknown keys"),
        (["{nope"], "invalid JSON"),
        (["a=/x", "a=/y"], "given twice"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_lora_paths(bad)
    from loom.config import LoRAArgs

    with pytest.raises(ValueError, match="unknown keys"):
        LoRAArgs(lora_paths=['{"lora_name": "c", "lora_path": "/z", "x": 1}'])


def test_more_adapters_than_slots_and_host_memory(lora_setup, peft_ref, third):  # noqa: F811
    """Three adapters (different target modules) with two device slots and one adapter in host
    memory, one of them pinned: one batch asks for all three and the base model. Every request
    gets peft's tokens; evicted adapters come back from disk; the pinned adapter never leaves
    its slot."""
    base, paths = lora_setup
    c_path, c_ref = third
    pinned = json.dumps({"lora_name": "b", "lora_path": paths["b"], "pinned": True})
    jobs = [(p, lo) for lo in ("a", "c", "b", None, "c", "a") for p in PROMPTS]
    specs = [f"a={paths['a']}", pinned, f"c={c_path}"]
    with _engine(
        base, specs, max_total_tokens=4096, max_loras_per_batch=2, max_loaded_loras=1
    ) as e:
        m = e.runner.lora_manager
        b_id = next(i for i, r in m.infos.items() if r.lora_name == "b")
        b_slot = m.slot_of(b_id)  # pinned: placed at start
        reads = m.loader.num_disk_reads
        outs = e.generate(
            input_ids=[p for p, _ in jobs],
            sampling_params=GREEDY,
            lora_path=[lo for _, lo in jobs],
        )
        for (p, lo), o in zip(jobs, outs, strict=True):
            want = c_ref[tuple(p)] if lo == "c" else peft_ref(lo, p)[0]
            assert o["output_ids"] == want, (p, lo)
        assert m.slot_ids[b_slot] == b_id
        assert len(m.loader.host) <= 1
        assert m.loader.num_disk_reads > reads  # a and c came back from disk
        # a and c took turns in the one unpinned slot
        assert m.num_slot_loads >= 3
        e.scheduler.check_kv_balance()
        assert not any(m.refs.values())


def test_pinning_is_bounded_and_pinned_adapters_keep_their_slot(lora_setup, peft_ref):  # noqa: F811
    base, paths = lora_setup
    with _engine(base, [], enable_lora=True, max_lora_rank=8, max_loras_per_batch=2) as e:
        e.load_lora_adapter("a", paths["a"], pinned=True)
        with pytest.raises(ValueError, match="at most --max-loras-per-batch - 1 = 1"):
            e.load_lora_adapter("b2", paths["b"], pinned=True)
        e.load_lora_adapter("b", paths["b"])
        m = e.runner.lora_manager
        a_id = next(i for i, r in m.infos.items() if r.lora_name == "a")
        slot = m.slot_of(a_id)
        for lo in ("b", "a", "b", None):
            out = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path=lo)
            assert out["output_ids"] == peft_ref(lo, PROMPTS[0])[0]
        assert m.slot_of(a_id) == slot and m.num_slot_loads == 2


def test_target_modules_size_the_pool(lora_setup, peft_ref):  # noqa: F811
    """--lora-target-modules decides which projections carry adapters: an adapter within them
    serves peft's tokens, one beyond them is refused naming the modules."""
    base, paths = lora_setup
    targets = ["qkv_proj", "down_proj"]
    with _engine(base, [], enable_lora=True, max_lora_rank=8, lora_target_modules=targets) as e:
        m = e.runner.lora_manager
        assert set(m.sizes) == {"qkv_proj", "down_proj"}
        with pytest.raises(ValueError, match="targets gate_proj, o_proj, up_proj, outside"):
            e.load_lora_adapter("b", paths["b"])
        e.load_lora_adapter("a", paths["a"])
        out = e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="a")
        assert out["output_ids"] == peft_ref("a", PROMPTS[1])[0]
    with pytest.raises(ValueError, match="unknown module 'lm_head'"):
        loom.Engine(
            model=base, skip_tokenizer_init=True, enable_lora=True, lora_target_modules=["lm_head"]
        )


def test_a_load_runs_beside_the_batch_and_a_corrupt_one_leaves_the_server_serving(
    lora_setup,  # noqa: F811
    peft_ref,  # noqa: F811
    tmp_path,
):
    """The checkpoint is read on the loader's thread: while a read is held up, requests are
    still served. A truncated checkpoint is refused by name, and the engine
    keeps serving with the adapters it has."""
    base, paths = lora_setup
    corrupt = tmp_path / "corrupt"
    shutil.copytree(paths["a"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: os.path.getsize(weights) // 2])
    with _engine(base, {"a": paths["a"]}, max_lora_rank=8, lora_target_modules=["all"]) as e:
        loader = e.runner.lora_manager.loader
        read = loader.read
        reading, release = threading.Event(), threading.Event()

        def gated_read(ref):
            reading.set()
            assert release.wait(60)
            return read(ref)

        loader.read = gated_read
        load = threading.Thread(target=e.load_lora_adapter, args=("b", paths["b"]))
        load.start()
        assert reading.wait(30)
        # the read is under way: requests are still served meanwhile
        for lo in ("a", None):
            out = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path=lo)
            assert out["output_ids"] == peft_ref(lo, PROMPTS[0])[0]
        assert load.is_alive() and e.lora_names == {"a"}
        release.set()
        load.join(60)
        assert e.lora_names == {"a", "b"}
        out = e.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora_path="b")
        assert out["output_ids"] == peft_ref("b", PROMPTS[2])[0]
        loader.read = read
        with pytest.raises(ValueError, match="LoRA adapter 'bad'"):
            e.load_lora_adapter("bad", str(corrupt))
        assert e.lora_names == {"a", "b"}
        out = e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="a")
        assert out["output_ids"] == peft_ref("a", PROMPTS[1])[0]
        e.scheduler.check_kv_balance()


def test_an_adapter_gone_from_disk_fails_its_requests_alone(lora_setup, peft_ref, tmp_path):  # noqa: F811
    """With one adapter in host memory, an evicted adapter whose files were deleted fails its
    request with a message naming it; the other adapter's and the base model's requests run."""
    base, paths = lora_setup
    gone = tmp_path / "gone"
    shutil.copytree(paths["a"], gone)
    specs = {"gone": str(gone), "b": paths["b"]}
    with _engine(base, specs, max_loaded_loras=1, max_loras_per_batch=1) as e:
        m = e.runner.lora_manager
        gone_id = next(i for i, r in m.infos.items() if r.lora_name == "gone")
        assert gone_id not in m.loader.host  # b's row evicted it at start
        shutil.rmtree(gone)
        outs = e.generate(
            input_ids=[PROMPTS[0]] * 3,
            sampling_params=GREEDY,
            lora_path=["gone", "b", None],
        )
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "'gone' could not be read again" in outs[0]["meta_info"]["finish_reason"]["message"]
        assert outs[1]["output_ids"] == peft_ref("b", PROMPTS[0])[0]
        assert outs[2]["output_ids"] == peft_ref(None, PROMPTS[0])[0]
        e.scheduler.check_kv_balance()


def test_sync_follows_the_schedulers_adapters_but_not_over_a_load_or_unload_under_way():
    a, b, c = LoRARef("a", "/a"), LoRARef("b", "/b"), LoRARef("c", "/c")
    reg = LoRARegistry([a, b])
    loading = reg.begin_load("d", "/d", False)
    unloading = reg.begin_unload("b")
    # another front end unloaded "a" and loaded "c"; "b" is still the scheduler's
    reg.sync((b, c))
    assert reg.names == ["c"]  # "b" stays away while this front end unloads it
    reg.sync((b, c, LoRARef("d", "/elsewhere")))
    assert reg.names == ["c"]  # and "d" is this front end's own load to finish
    reg.end_load(loading, ok=True)
    reg.end_unload(unloading, ok=False)  # refused (another front end's request used it)
    assert reg.names == ["b", "c", "d"] and reg.get("d") is loading
