"""``loom bench offline``: N requests of given (or seeded random) lengths through the Engine, and
optionally the same requests through HF transformers ``generate()`` in the same process."""

from __future__ import annotations

import argparse
import gc
import random
import time
from dataclasses import fields
from typing import Any

import torch

from loom.bench import append_result
from loom.bench.workload import make_requests
from loom.scheduler.scheduler import SchedulerStats
from loom.scheduler.stats import hist_delta, new_hist


def add_offline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths are drawn from [ratio * len, len] (1.0: fixed lengths)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    g.add_argument(
        "--compare-hf",
        action="store_true",
        help="also run HF transformers generate() on the same requests",
    )
    g.add_argument("--hf-batch-size", type=int, default=16)
    g.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="run HF on only the first N requests (its rate is per output token either way)",
    )
    g.add_argument("--result-file", default=None, help="append a JSON line with the results")
    g.add_argument(
        "--engine-backend",
        choices=("thread", "process"),
        default="thread",
        help="process: the scheduler in a process of its own (as `loom serve` runs it), so "
        "that this process's handling of the outputs does not share its interpreter lock, and "
        "all its device memory is returned before --compare-hf builds HF's model",
    )
    g.add_argument(
        "--request-lora",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters (from --lora-paths; 'none': the base model) given to the requests "
        "in turn; the same requests first run on the base model alone in the same engine "
        "(the prefix cache flushed between), and both rates are reported",
    )
    g.add_argument(
        "--sampling",
        choices=("greedy", "penalties"),
        default="greedy",
        help="penalties: temperature 0.8, top_p 0.9, frequency 0.5, presence 0.3, repetition "
        "1.1 and a logit_bias on 16 tokens, for every request (unseeded)",
    )


def sampling_preset(name: str, vocab: int) -> dict[str, Any]:
    if name == "greedy":
        return {"temperature": 0}
    rng = random.Random(7)
    return {
        "temperature": 0.8,
        "top_p": 0.9,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "repetition_penalty": 1.1,
        "logit_bias": {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(16)},
    }


def run_loom(
    engine,
    reqs: list[tuple[list[int], int]],
    preset: str = "greedy",
    loras: list[str | None] | None = None,
) -> dict[str, Any]:
    """One timed batch of ``reqs``; ``loras``: adapter names given to the requests in turn."""
    lora_path = None
    if loras:
        lora_path = [loras[i % len(loras)] for i in range(len(reqs))]
    for name in sorted(set(lora_path or [None]), key=str):  # warm-up, each adapter's slot too
        engine.generate(
            input_ids=reqs[0][0][:8],
            sampling_params={"max_new_tokens": 4, "temperature": 0},
            lora_path=name,
        )
    extra = sampling_preset(preset, engine.vocab_size)
    params = [{"max_new_tokens": n, "ignore_eos": True, **extra} for _, n in reqs]
    before = dict(engine.get_server_info())
    start = time.perf_counter()
    outs = engine.generate(
        input_ids=[ids for ids, _ in reqs], sampling_params=params, lora_path=lora_path
    )
    elapsed = time.perf_counter() - start
    steps = step_profile(before, engine.get_server_info())
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    tpots = [
        (o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"])
        / (o["meta_info"]["completion_tokens"] - 1)
        for o in outs
        if o["meta_info"]["completion_tokens"] > 1
    ]
    return {
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "mean_tpot_ms": 1000 * sum(tpots) / max(1, len(tpots)),
        "steps": steps,
        "output_ids": [o["output_ids"] for o in outs],
    }


# the scheduler's counters (SchedulerStats), whose differences over a run make its step profile
_STEP_KEYS = tuple(f.name for f in fields(SchedulerStats))


def step_profile(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Where the scheduler's time went during a run: the counters' differences."""
    d = {}
    for k in _STEP_KEYS:
        if k.startswith("step_hist_"):
            d[k] = hist_delta(after.get(k) or new_hist(), before.get(k))
        else:
            d[k] = after.get(k, 0) - before.get(k, 0)
    for k in _STEP_KEYS:
        if k.endswith("_max_s"):  # a running maximum, not a sum (it may predate the run)
            d[k] = after.get(k, 0.0)
    d["mean_decode_batch"] = d["num_decode_tokens"] / max(1, d["num_decode_batches"])
    return d


def format_step_profile(p: dict[str, Any]) -> str:
    out = (
        f"  steps: {p['num_prefill_batches']} prefill ({p['num_prompt_tokens']} prompt tokens, "
        f"{p['time_prefill_s']:.2f} s), {p['num_decode_batches']} decode (mean batch "
        f"{p['mean_decode_batch']:.1f}, {p['time_decode_s']:.2f} s); host blocked on the device "
        f"{p['time_device_wait_s']:.2f} s; {p['num_retractions']} retractions; overlapped: "
        f"{p['num_overlapped_batches']} decode, {p['num_overlapped_prefill_batches']} prefill"
    )
    return out + "\n  " + host_phases(p)


def host_phases(p: dict[str, Any]) -> str:
    """Host time of a decode step by phase, in microseconds (device waits excluded)."""
    n = max(1, p["num_decode_batches"])

    def us(key: str) -> float:
        return 1e6 * p.get(key, 0.0) / n

    return (
        f"decode step host us: forward launch {us('time_forward_launch_s'):.0f}, sampling "
        f"{us('time_sampling_launch_s'):.0f} (grammar masks {us('time_grammar_mask_s'):.0f}), "
        f"resolve {us('time_resolve_s'):.0f}, device wait {us('time_device_wait_s'):.0f}, "
        f"total {us('time_decode_s'):.0f}"
    ) + device_timeline(p)


def device_timeline(p: dict[str, Any]) -> str:
    """CUDA: the device's own time per decode step, and its idle time before chained steps
    (from events on the stream), in microseconds."""
    busy = p.get("time_device_decode_s", 0.0)
    if not busy:
        return ""
    n = max(1, p["num_decode_batches"])
    chained = max(1, p["num_overlapped_batches"])
    idle = p.get("time_device_idle_chained_s", 0.0)
    return (
        f"; device us a step: busy {1e6 * busy / n:.0f}, idle before a chained step "
        f"{1e6 * idle / chained:.0f} ({idle:.2f} s in all; over 0.5 ms before "
        f"{p.get('num_device_idle_chained_steps', 0)} steps, the longest "
        f"{1e3 * p.get('time_device_idle_chained_max_s', 0.0):.1f} ms)"
    )


def build_hf_model(cfg, loader, device: torch.device):
    """An HF transformers model with the same weights as the engine's (read by the engine's own
    loader; a loader that reads no checkpoint, e.g. dummy, leaves HF's random init)."""
    from transformers import AutoModelForCausalLM

    if hasattr(loader, "_pick"):
        loader = loader._pick(cfg.path)
    with torch.device(device):  # initialise on the GPU: an 8B model takes minutes on CPU
        model = AutoModelForCausalLM.from_config(cfg.hf_config, dtype=cfg.dtype)
    iterate = getattr(loader, "iterate_weights", None)
    if iterate is not None:
        try:
            weights = dict(iterate(cfg.path, cfg.hf_config))
        except TypeError:
            weights = dict(iterate(cfg.path))
        missing, _ = model.load_state_dict(weights, strict=False)
        missing = [
            m
            for m in missing
            if "rotary" not in m
            and not (m == "lm_head.weight" and getattr(cfg.hf_config, "tie_word_embeddings", False))
        ]
        if missing:
            raise ValueError(f"HF model is missing weights: {missing[:5]}")
        if getattr(cfg.hf_config, "tie_word_embeddings", False):
            model.tie_weights()
    return model.to(device).eval()


def hf_model_for(engine):
    """:func:`build_hf_model` for a running in-process engine (both models stay in memory)."""
    runner = engine.runner
    return build_hf_model(runner.model_config, runner.loader, runner.device)


@torch.inference_mode()
def run_hf(
    model, reqs: list[tuple[list[int], int]], batch_size: int, pad_id: int, device: torch.device
) -> dict[str, Any]:
    def batch_generate(chunk):
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (ids, _) in enumerate(chunk):  # left padding
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        n_out = max(n for _, n in chunk)
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=pad_id,
        )
        return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(chunk)]

    batch_generate(reqs[:1])  # warm-up
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(reqs), batch_size):
        outputs += batch_generate(reqs[i : i + batch_size])
    elapsed = time.perf_counter() - start
    out_tokens = sum(n for _, n in reqs)
    return {
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "output_ids": outputs,
    }


def run_offline(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    from loom.config import ServerArgs
    from loom.engine.engine import Engine
    from loom.model_executor.model_runner import resolve_device, resolve_dtype
    from loom.model_executor.weights import model_config_for

    if ns.compare_hf and ns.request_lora:
        raise SystemExit("--compare-hf runs HF's base model: leave out --request-lora")
    with Engine(backend=ns.engine_backend, **server_kwargs) as engine:
        reqs = make_requests(
            ns.num_prompts,
            ns.input_len,
            ns.output_len,
            ns.random_range_ratio,
            engine.vocab_size,
            ns.seed,
        )
        info = engine.get_server_info()
        base = None
        loras = None
        if ns.request_lora:
            loras = [None if n == "none" else n for n in ns.request_lora]
            base = run_loom(engine, reqs, ns.sampling)
            print(
                f"Loom, base model alone: {base['output_tokens_per_s']:.1f} output tokens/s, "
                f"mean TPOT {base['mean_tpot_ms']:.1f} ms, {base['elapsed_s']:.2f} s"
            )
            engine.flush_cache()  # the adapters' run must not reuse the base run's prompts
        loom = run_loom(engine, reqs, ns.sampling, loras)
        if base is not None:
            print(f"with LoRA adapters in turn: {', '.join(ns.request_lora)}")
        print(
            f"Loom  ({info['device']}, {info['dtype']}, KV cache "
            f"{info.get('kv_cache_dtype', 'auto')}, {info['attention_backend']}, "
            f"{ns.num_prompts} requests, in {ns.input_len} / out {ns.output_len}): "
            f"{loom['output_tokens_per_s']:.1f} output tokens/s, "
            f"mean TPOT {loom['mean_tpot_ms']:.1f} ms, {loom['elapsed_s']:.2f} s"
        )
        print(format_step_profile(loom["steps"]))
        result = {
            "num_prompts": ns.num_prompts,
            "input_len": ns.input_len,
            "output_len": ns.output_len,
            "device": info["device"],
            "dtype": info["dtype"],
            "max_running_requests": info["max_running_requests"],
            "attention_backend": info["attention_backend"],
            "kv_cache_dtype": info.get("kv_cache_dtype", "auto"),
            "cuda_graphs": info.get("cuda_graphs"),
            "overlap": not server_kwargs.get("disable_overlap_schedule", False),
            "random_range_ratio": ns.random_range_ratio,
            "sampling": ns.sampling,
            "loom": {k: v for k, v in loom.items() if k != "output_ids"},
        }
        if base is not None:
            result["request_lora"] = ns.request_lora
            result["base"] = {k: v for k, v in base.items() if k != "output_ids"}
            result["lora_vs_base"] = loom["output_tokens_per_s"] / base["output_tokens_per_s"]
            print(f"LoRA / base: {result['lora_vs_base']:.3f}x")
        pad = engine.eos_token_ids and min(engine.eos_token_ids) or 0
    if ns.compare_hf:
        # HF's model is built once the engine is gone: with the process backend its memory is
        # all returned (Mixtral-8x7B's 93 GB twice does not fit on one H200).
        del engine
        gc.collect()
        args = ServerArgs.from_kwargs(**server_kwargs)
        device = resolve_device(args.device)
        loader, cfg = model_config_for(args, resolve_dtype(args.dtype, device))
        model = build_hf_model(cfg, loader, device)
        hf_reqs = reqs[: ns.hf_num_prompts] if ns.hf_num_prompts else reqs
        hf = run_hf(model, hf_reqs, ns.hf_batch_size, pad, device)
        ratio = loom["output_tokens_per_s"] / hf["output_tokens_per_s"]
        same = sum(a == b for a, b in zip(loom["output_ids"], hf["output_ids"], strict=False))
        print(
            f"HF    (transformers generate(), batch {ns.hf_batch_size}, "
            f"{len(hf_reqs)} requests): "
            f"{hf['output_tokens_per_s']:.1f} output tokens/s, {hf['elapsed_s']:.2f} s"
        )
        print(f"Loom / HF: {ratio:.2f}x; identical greedy outputs: {same}/{len(hf_reqs)}")
        result["hf"] = {k: v for k, v in hf.items() if k != "output_ids"}
        result["hf"]["batch_size"] = ns.hf_batch_size
        result["hf"]["num_prompts"] = len(hf_reqs)
        result["ratio"] = ratio
        result["identical_outputs"] = same
    append_result(ns.result_file, result)
    return 0
