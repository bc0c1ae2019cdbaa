"""Multi-LoRA serving against peft: adapters made with peft (real PEFT checkpoints) on a tiny
random Llama; Loom's greedy tokens and logits for a batch that mixes adapters and the base model
equal peft's own forward with each adapter set."""

from __future__ import annotations

import pytest
import torch

import loom
from tests.conftest import http_get, http_post, save_tiny_llama

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _make_adapter(base_dir: str, out: str, seed: int, **config) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    # peft's random B is small next to the base weights: scale both up so each adapter changes
    # the greedy tokens (checked below)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base", initializer_range=0.2)
    a = _make_adapter(
        base,
        str(root / "a"),
        1,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )
    b = _make_adapter(
        base,
        str(root / "b"),
        2,
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        rank_pattern={"o_proj": 2},
        alpha_pattern={"down_proj": 4},
    )
    return base, {"a": a, "b": b}


@pytest.fixture(scope="module")
def peft_ref(lora_setup):
    """peft's greedy tokens and first-step logits per (adapter or None, prompt)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, paths = lora_setup
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(model, paths["a"], adapter_name="a")
    peft_model.load_adapter(paths["b"], adapter_name="b")
    peft_model.eval()

    @torch.inference_mode()
    def run(adapter: str | None, prompt: list[int]):
        ids = torch.tensor([prompt])
        if adapter is None:
            with peft_model.disable_adapter():
                return _greedy(peft_model, ids)
        peft_model.set_adapter(adapter)
        return _greedy(peft_model, ids)

    return run


def _greedy(model, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    first = model(input_ids=ids).logits[0, -1]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=GREEDY["max_new_tokens"],
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist(), first


PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 2, 2, 81], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def _engine(base, paths, **kw):
    """``paths``: {name: path}, or ``--lora-paths`` entries as they are."""
    kw = {"max_total_tokens": 2048, **kw}
    specs = paths if isinstance(paths, list) else [f"{n}={p}" for n, p in paths.items()]
    return loom.Engine(model=base, skip_tokenizer_init=True, lora_paths=specs, **kw)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_mixed_batch_matches_peft(lora_setup, peft_ref, backend):
    """One batch: every prompt with adapter a, adapter b and no adapter (decode steps mix all
    three; prefill too). Greedy tokens equal peft's for each, with either lora_backend (the
    Triton kernels run in Triton's interpreter without a GPU)."""
    if backend == "triton":
        pytest.importorskip("triton")
    base, paths = lora_setup
    jobs = [(p, lo) for p in PROMPTS for lo in ("a", "b", None)]
    with _engine(base, paths, lora_backend=backend) as e:
        assert e.runner.lora_manager.backend.name == backend
        outs = e.generate(
            input_ids=[p for p, _ in jobs],
            sampling_params=GREEDY,
            lora_path=[lo for _, lo in jobs],
        )
        e.scheduler.check_kv_balance()
    got = {(tuple(p), lo): o["output_ids"] for (p, lo), o in zip(jobs, outs, strict=True)}
    for p in PROMPTS:
        want = {lo: peft_ref(lo, p)[0] for lo in ("a", "b", None)}
        # the adapters matter: each changes the base model's tokens
        assert want["a"] != want[None] and want["b"] != want[None] and want["a"] != want["b"]
        for lo in ("a", "b", None):
            assert got[(tuple(p), lo)] == want[lo], (p, lo)


def test_prefill_logits_match_peft(lora_setup, peft_ref):
    base, paths = lora_setup
    with _engine(base, paths) as e:
        for lo in ("a", "b"):
            out = e.generate(
                input_ids=PROMPTS[0],
                sampling_params={**GREEDY, "max_new_tokens": 1},
                lora_path=lo,
                return_logprob=True,
                top_logprobs_num=5,
            )
            want = torch.log_softmax(peft_ref(lo, PROMPTS[0])[1].float(), -1)
            top = out["meta_info"]["output_top_logprobs"][0]
            assert len(top) == 5
            for logprob, token, *_ in top:
                assert abs(logprob - float(want[token])) < 1e-4, (lo, token)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_one_slot_serves_two_adapters_in_turn(lora_setup, peft_ref, policy):
    """With a single device slot, requests for two adapters cannot run together: the second
    adapter's requests wait until the first's are done, take the slot, and still give peft's
    tokens. Base-model requests run alongside either, and a later request for the first adapter
    does not pass the waiting one (a, then b, then a again: three loads into the slot)."""
    base, paths = lora_setup
    jobs = [(PROMPTS[0], "a"), (PROMPTS[1], "b"), (PROMPTS[2], None), (PROMPTS[1], "a")]
    with _engine(base, paths, max_loras_per_batch=1, lora_eviction_policy=policy) as e:
        outs = e.generate(
            input_ids=[p for p, _ in jobs],
            sampling_params=GREEDY,
            lora_path=[lo for _, lo in jobs],
        )
        e.scheduler.check_kv_balance()
        lora = e.runner.lora_manager
        assert lora.num_slot_loads == 3 and not any(lora.refs.values())
    for (p, lo), o in zip(jobs, outs, strict=True):
        assert o["output_ids"] == peft_ref(lo, p)[0], (p, lo)


def test_chunked_prefill_and_retraction_keep_peft_tokens(lora_setup, peft_ref):
    """Adapters through chunked prefill (4-token chunks) and through retraction (a pool too
    small for the batch, admitted greedily): tokens still equal peft's, and slots and pages
    balance afterwards."""
    base, paths = lora_setup
    jobs = [(p + [60 + i] * 20, lo) for i, p in enumerate(PROMPTS) for lo in ("a", "b")]
    total = max(len(p) for p, _ in jobs) * 3 + 16
    with _engine(
        base,
        paths,
        max_total_tokens=total,
        chunked_prefill_size=4,
        schedule_conservativeness=0.0,
        max_loras_per_batch=2,
    ) as e:
        outs = e.generate(
            input_ids=[p for p, _ in jobs],
            sampling_params={**GREEDY, "max_new_tokens": 24},
            lora_path=[lo for _, lo in jobs],
        )
        assert e.scheduler.stats.num_retractions > 0
        e.scheduler.check_kv_balance()
    for (p, lo), o in zip(jobs, outs, strict=True):
        assert o["output_ids"][:12] == peft_ref(lo, p)[0], (p, lo)


def test_an_aborted_request_gives_its_slot_back(lora_setup, peft_ref):
    base, paths = lora_setup
    with _engine(base, paths, max_loras_per_batch=1) as e:
        stream = e.generate(
            input_ids=PROMPTS[0],
            sampling_params={**GREEDY, "max_new_tokens": 200},
            lora_path="a",
            stream=True,
            rid="long",
        )
        next(stream)
        assert e.runner.lora_manager.in_use("a") == 1
        e.abort_request("long")
        last = list(stream)[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        # the one slot is free for the other adapter
        out = e.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="b")
        assert out["output_ids"] == peft_ref("b", PROMPTS[1])[0]
        assert not any(e.runner.lora_manager.refs.values())
        e.scheduler.check_kv_balance()


def test_prefix_cache_is_per_adapter(lora_setup):
    """KV computed under one adapter is reused by the same adapter and never by another (nor by
    the base model)."""
    base, paths = lora_setup
    prompt = list(range(40, 80))
    with _engine(base, paths, page_size=1) as e:
        first = e.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        same = e.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        other = e.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="b")
        plain = e.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert same["output_ids"] == first["output_ids"]
    assert other["meta_info"]["cached_tokens"] == 0
    assert plain["meta_info"]["cached_tokens"] == 0


def test_bad_adapter_requests_are_refused(lora_setup, tmp_path):
    base, paths = lora_setup
    with _engine(base, paths) as e:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'c'; loaded: a, b"):
            e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="c")
        # the engine keeps serving
        assert len(e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"]) == 12
    with loom.Engine(model=base, skip_tokenizer_init=True, max_total_tokens=1024) as e:
        with pytest.raises(ValueError, match="no adapters"):
            e.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="a")


def test_unsupported_adapters_fail_at_start_up(lora_setup, tmp_path):
    """An adapter the engine cannot serve is refused when the engine starts, naming why."""
    import json
    import shutil

    base, paths = lora_setup
    dora = tmp_path / "dora"
    shutil.copytree(paths["a"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        loom.Engine(model=base, skip_tokenizer_init=True, lora_paths=[f"d={dora}"])
    other = save_tiny_llama(tmp_path / "wide", hidden_size=128, intermediate_size=256)
    with pytest.raises(ValueError, match="LoRA adapter 'a'.*the model's is"):
        loom.Engine(model=other, skip_tokenizer_init=True, lora_paths=[f"a={paths['a']}"])
    with pytest.raises(ValueError, match="above --max-lora-rank 4"):
        loom.Engine(
            model=base, skip_tokenizer_init=True, lora_paths=[f"b={paths['b']}"], max_lora_rank=4
        )


def test_adapters_load_and_unload_while_serving(lora_setup, peft_ref):
    """An engine started with --enable-lora and no adapters: an adapter loaded while serving
    gives peft's tokens; loading a name twice, a missing path or a rank above the pool's is
    refused by name; an unload while a request uses the adapter refuses new requests for it at
    once, waits for the running one to end, then returns, after which the name is unknown."""
    import threading

    base, paths = lora_setup
    with _engine(base, [], enable_lora=True, max_lora_rank=4) as e:
        e.load_lora_adapter("a", paths["a"])
        out = e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        assert out["output_ids"] == peft_ref("a", PROMPTS[0])[0]
        with pytest.raises(ValueError, match="'a' is already loaded"):
            e.load_lora_adapter("a", paths["a"])
        with pytest.raises(ValueError, match="no adapter_config.json"):
            e.load_lora_adapter("x", paths["a"] + "-missing")
        with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
            e.load_lora_adapter("b", paths["b"])
        assert e.lora_names == {"a"}
        stream = e.generate(
            input_ids=PROMPTS[1],
            sampling_params={**GREEDY, "max_new_tokens": 200},
            lora_path="a",
            stream=True,
        )
        first = next(stream)  # running now
        done = threading.Event()
        unload = threading.Thread(target=lambda: (e.unload_lora_adapter("a"), done.set()))
        unload.start()
        while "a" in e.lora_names:
            pass
        with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
            e.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="a")
        # the stream holds the adapter until its last output is taken
        assert not done.wait(0.5)
        rest = list(stream)
        unload.join(timeout=30)
        assert done.is_set()
        assert [*rest, first][0]["meta_info"]["finish_reason"]["type"] == "length"
        assert e.runner.lora_manager.names == []
        e.scheduler.check_kv_balance()


def test_server_routes_pick_adapters(lora_setup, peft_ref):
    """`loom serve --lora-paths`: /generate's `lora_path` and the OpenAI model "BASE:NAME" (or
    "NAME") pick an adapter, /v1/models lists them, and an unknown adapter is a 404 (OpenAI
    route) or a 400 (native route) naming the adapters served."""

    from tests.test_server import Server

    base, paths = lora_setup
    s = Server(
        "--model",
        base,
        "--skip-tokenizer-init",
        "--lora-paths",
        *[f"{n}={p}" for n, p in paths.items()],
    )
    try:
        ids = [m["id"] for m in http_get(s.url + "/v1/models").json()["data"]]
        assert ids[1:] == ["a", "b"]
        r = http_post(
            s.url + "/generate",
            json={
                "input_ids": [PROMPTS[0], PROMPTS[1]],
                "sampling_params": GREEDY,
                "lora_path": ["b", None],
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out[0]["output_ids"] == peft_ref("b", PROMPTS[0])[0]
        assert out[1]["output_ids"] == peft_ref(None, PROMPTS[1])[0]
        for model in (f"{ids[0]}:a", "a"):
            r = http_post(
                s.url + "/v1/completions",
                json={
                    "model": model,
                    "prompt": PROMPTS[2],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
        r = http_post(
            s.url + "/v1/completions",
            json={"model": "nope", "prompt": PROMPTS[2], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 404 and "'a', 'b'" in r.json()["error"]["message"]
        r = http_post(
            s.url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "c"},
            timeout=60,
        )
        assert r.status_code == 400 and "unknown LoRA adapter 'c'" in r.json()["error"]["message"]
        # adapters loaded and unloaded while serving
        r = http_post(
            s.url + "/load_lora_adapter",
            json={"lora_name": "c", "lora_path": paths["a"]},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["loaded_adapters"] == ["a", "b", "c"], r.text
        r = http_post(
            s.url + "/generate",
            json={"input_ids": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "c"},
            timeout=60,
        )
        assert r.json()["output_ids"] == peft_ref("a", PROMPTS[0])[0]
        r = http_post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
        assert r.status_code == 200 and r.json()["loaded_adapters"] == ["a", "b"], r.text
        r = http_post(
            s.url + "/load_lora_adapter",
            json={"lora_name": "d", "lora_path": "/nonexistent"},
            timeout=60,
        )
        assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.parametrize(
    "arch,impl,match",
    [
        ("MixtralForCausalLM", "auto", "layer 0 has no mlp.gate_up_proj"),
        ("LlamaForCausalLM", "transformers", "not supported on TransformersForCausalLM"),
    ],
)
def test_lora_on_a_model_without_dense_projections_is_refused_by_name(tmp_path, arch, impl, match):
    from transformers import AutoModelForCausalLM

    from loom.testing import tiny_config

    AutoModelForCausalLM.from_config(tiny_config(arch)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        loom.Engine(
            model=str(tmp_path),
            model_impl=impl,
            enable_lora=True,
            skip_tokenizer_init=True,
            max_total_tokens=1024,
        )
