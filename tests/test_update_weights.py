"""``Engine.update_weights_from_disk`` and ``POST /update_weights_from_disk`` (SGLang's): weights
swapped in place between steps; the oracle is a fresh engine started on the new checkpoint."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

import loom
from tests.conftest import save_tiny_llama

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
KW = dict(skip_tokenizer_init=True, max_total_tokens=2048, dtype="float32")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("update-weights")
    a = save_tiny_llama(root / "a", seed=0, vocab_size=256, initializer_range=0.2)
    b = save_tiny_llama(root / "b", seed=1, vocab_size=256, initializer_range=0.2)
    wide = save_tiny_llama(root / "wide", seed=2, vocab_size=256, intermediate_size=96)
    return a, b, wide


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 30)]


def _greedy(engine, prompts=None):
    outs = engine.generate(input_ids=prompts or _prompts(), sampling_params=PARAMS)
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def want(ckpts):
    """Each checkpoint's greedy tokens from an engine started on it."""
    out = {}
    for path in ckpts[:2]:
        with loom.Engine(model=path, **KW) as e:
            out[path] = _greedy(e)
    assert out[ckpts[0]] != out[ckpts[1]]
    return out


def test_swap_gives_the_new_checkpoints_tokens_and_refusals_keep_the_old(ckpts, want):
    a, b, wide = ckpts
    with loom.Engine(model=a, **KW) as e:
        assert _greedy(e) == want[a]
        graphs_before = e.runner.model.model.layers[0].mlp.down_proj.weight.data_ptr()
        ok, message, paused = e.update_weights_from_disk(b)
        assert ok and paused == 0, message
        assert e.runner.model.model.layers[0].mlp.down_proj.weight.data_ptr() == graphs_before
        assert _greedy(e) == want[b]  # the prefix cache held a's KV for these prompts
        assert e.get_server_info()["model_path"] == b
        for bad, names in (
            (str(a) + "-missing", "missing"),
            (wide, "gate_up_proj.weight is torch.float32 (192, 64)"),
        ):
            ok, message, _ = e.update_weights_from_disk(bad)
            assert not ok and names in message, message
            assert _greedy(e) == want[b]
        e.scheduler.check_kv_balance()


@pytest.mark.parametrize("abort", [False, True])
def test_requests_running_during_a_swap_pause_or_abort(ckpts, abort):
    """A long request running when the swap comes is paused (retracted, then finished on the new
    weights: its whole length, no error) or, with abort_all_requests, ended as aborted; the pool
    balances either way."""
    a, b, _ = ckpts
    with loom.Engine(model=a, **KW) as e:
        result = {}

        def run():
            result["out"] = e.generate(
                input_ids=_prompts()[1], sampling_params={**PARAMS, "max_new_tokens": 200}
            )

        t = threading.Thread(target=run)
        t.start()
        stream_started = False
        for _ in range(200):  # until the request is decoding
            if e.scheduler.decode.running:
                stream_started = True
                break
            threading.Event().wait(0.01)
        assert stream_started
        ok, message, paused = e.update_weights_from_disk(b, abort_all_requests=abort)
        t.join(120)
        assert ok, message
        out = result["out"]
        reason = out["meta_info"]["finish_reason"]
        if abort:
            assert paused == 0 and reason["type"] == "abort"
        else:
            assert paused == 1 and reason["type"] == "length"
            assert len(out["output_ids"]) == 200
        e.scheduler.check_kv_balance()


@pytest.mark.parametrize("fronts", [1, 2])
def test_http_update_weights_from_disk(ckpts, want, fronts):
    """With two front-end processes the answer comes back to the one that asked, and every
    front end serves and reports the new weights."""
    from tests.test_server import Server

    a, b, _ = ckpts
    s = Server(
        "--model", a, "--skip-tokenizer-init", "--dtype", "float32",
        "--tokenizer-worker-num", str(fronts),
    )  # fmt: skip
    try:
        r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": b}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "success": True,
            "message": f"weights updated from {b}",
            "num_paused_requests": 0,
        }
        seen = set()
        for _ in range(200):  # each front end, on a connection of its own
            with httpx.Client(timeout=120) as c:
                info = c.get(s.url + "/server_info").json()
                if info["front_end"] in seen:
                    continue
                seen.add(info["front_end"])
                for _ in range(30):  # (a front end hears the scheduler's figures each second)
                    if info["model_path"] == b:
                        break
                    time.sleep(0.1)
                    info = c.get(s.url + "/server_info").json()
                assert info["model_path"] == b
                gen = c.post(
                    s.url + "/generate",
                    json={"input_ids": _prompts()[0], "sampling_params": PARAMS},
                ).json()
                assert gen["output_ids"] == want[b][0]
            if len(seen) == fronts:
                break
        assert seen == set(range(fronts))
        r = httpx.post(
            s.url + "/update_weights_from_disk", json={"model_path": "/nowhere"}, timeout=120
        )
        assert r.status_code == 400 and r.json()["success"] is False
        r = httpx.post(s.url + "/update_weights_from_disk", json={}, timeout=30)
        assert r.status_code == 400 and "model_path" in r.text
    finally:
        s.stop()


def test_a_swap_another_rank_refuses_copies_nothing(ckpts):
    """Tensor parallelism: a rank whose own load succeeded copies nothing when another rank's
    failed (the agreement before the copy), and answers that rank's error."""
    from loom.model_executor.weights import swap_weights

    a, b, _ = ckpts
    with loom.Engine(model=a, **KW) as e:
        runner = e.runner
        before = {k: v.clone() for k, v in runner.model.state_dict().items()}
        seen = []

        def agree(error):
            seen.append(error)
            return "rank 1: cannot read model.safetensors"

        args = runner.args.replace(model=b)
        with pytest.raises(ValueError, match="rank 1: cannot read"):
            swap_weights(
                runner.model, runner.model_config, args, runner.dtype, runner.device, agree
            )
        assert seen == [None]  # this rank's own load and checks passed
        after = runner.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
