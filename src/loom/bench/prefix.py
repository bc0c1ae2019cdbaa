"""``loom bench prefix``: workloads for the prefix cache and the hierarchical cache.

- ``shared``: ``--num-prompts`` requests that share a ``--prefix-len``-token system prompt, each
  with its own ``--input-len``-token question, submitted together.
- ``random``: distinct prompts of ``--input-len`` tokens (a 0% hit rate: the cache's overhead).
- ``multiturn``: ``--num-convs`` conversations of ``--turns`` turns; each turn appends
  ``--input-len`` user tokens to the conversation so far (its earlier prompts and replies) and
  asks for ``--output-len`` tokens. Turns go round-robin over the conversations, one request at
  a time, so a conversation's history must survive everyone else's turns to be reused; size the
  device pool with ``--max-total-tokens`` to study the hierarchical cache.

Prints throughput, TTFT and the cached-token share; ``--result-file`` appends a JSON line. Run
it once per configuration (e.g. with and without ``--disable-radix-cache``) in one command.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from loom.bench import append_result


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--workload", choices=("shared", "random", "multiturn"), default="shared")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--input-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=16)
    g.add_argument("--num-convs", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tag", default="", help="a label stored with the result")
    g.add_argument("--result-file", default=None)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo = min(1000, vocab // 2)
    return [rng.randrange(lo, vocab) for _ in range(n)]


def _summary(outs: list[dict[str, Any]], elapsed: float) -> dict[str, Any]:
    ttft = sorted(o["meta_info"]["ttft"] * 1000 for o in outs)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "requests": len(outs),
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "requests_per_s": len(outs) / elapsed,
        "ttft_mean_ms": statistics.fmean(ttft),
        "ttft_p50_ms": ttft[len(ttft) // 2],
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / max(1, prompt),
    }


def run_prefix(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    from loom.engine.engine import Engine

    rng = random.Random(ns.seed)
    params = {"max_new_tokens": ns.output_len, "temperature": 0, "ignore_eos": True}
    with Engine(**server_kwargs) as engine:
        vocab = engine.runner.vocab_size
        engine.generate(input_ids=_tokens(random.Random(-1), 8, vocab), sampling_params=params)
        engine.flush_cache()
        time.sleep(0.2)
        if ns.workload == "multiturn":
            convs = [[] for _ in range(ns.num_convs)]
            outs, later = [], []
            start = time.perf_counter()
            for turn in range(ns.turns):
                for c in range(ns.num_convs):
                    convs[c] += _tokens(rng, ns.input_len, vocab)
                    o = engine.generate(input_ids=convs[c], sampling_params=params)
                    convs[c] += o["output_ids"]
                    outs.append(o)
                    if turn > 0:
                        later.append(o)
            result = _summary(outs, time.perf_counter() - start)
            result["later_turns"] = _summary(later, 1.0) if later else None
        else:
            if ns.workload == "shared":
                prefix = _tokens(rng, ns.prefix_len, vocab)
                prompts = [
                    prefix + _tokens(rng, ns.input_len, vocab) for _ in range(ns.num_prompts)
                ]
            else:
                prompts = [_tokens(rng, ns.input_len, vocab) for _ in range(ns.num_prompts)]
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            result = _summary(outs, time.perf_counter() - start)
        info = engine.get_server_info()
    result.update(
        bench="prefix",
        workload=ns.workload,
        tag=ns.tag,
        device=info["device"],
        dtype=info["dtype"],
        radix_cache=not server_kwargs.get("disable_radix_cache", False),
        hierarchical=bool(server_kwargs.get("enable_hierarchical_cache", False)),
        max_total_tokens=info.get("max_total_tokens"),
        args={
            k: getattr(ns, k)
            for k in ("num_prompts", "prefix_len", "input_len", "output_len", "num_convs", "turns")
        },
    )
    extra = ""
    if result.get("later_turns"):
        lt = result["later_turns"]
        extra = f"; turns 2+: TTFT mean {lt['ttft_mean_ms']:.1f} ms, hit rate {lt['hit_rate']:.2f}"
    print(
        f"Loom prefix/{ns.workload} {ns.tag}: {result['output_tokens_per_s']:.1f} output tok/s, "
        f"{result['requests_per_s']:.2f} req/s, TTFT mean {result['ttft_mean_ms']:.1f} ms "
        f"(p50 {result['ttft_p50_ms']:.1f}, p99 {result['ttft_p99_ms']:.1f}), hit rate "
        f"{result['hit_rate']:.2f}, {result['elapsed_s']:.2f} s{extra}"
    )
    append_result(ns.result_file, result)
    return 0
