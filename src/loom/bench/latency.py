"""``loom bench latency``: one batch of B identical-length requests run together; prints the
prefill time, decode time per step and output tokens/s."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from loom.bench import append_result
from loom.bench.workload import make_requests


def add_latency_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--runs", type=int, default=2, help="timed runs after one warm-up")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--result-file", default=None)


def run_latency(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    from loom.engine.engine import Engine

    server_kwargs = dict(server_kwargs)
    if server_kwargs.get("max_running_requests") is None:
        server_kwargs["max_running_requests"] = ns.batch_size
    with Engine(**server_kwargs) as engine:
        info = engine.get_server_info()
        reqs = make_requests(
            ns.batch_size, ns.input_len, ns.output_len, 1.0, engine.vocab_size, ns.seed
        )
        params = {"max_new_tokens": ns.output_len, "temperature": 0, "ignore_eos": True}
        ids = [r[0] for r in reqs]
        engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 8})
        runs = []
        for _ in range(ns.runs):
            engine.flush_cache()  # each run prefills its whole prompt, not the radix cache's hit
            start = time.perf_counter()
            outs = engine.generate(input_ids=ids, sampling_params=params)
            total = time.perf_counter() - start
            prefill = max(o["meta_info"]["ttft"] for o in outs)
            decode = statistics.fmean(
                (o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"]) / (ns.output_len - 1)
                for o in outs
            )
            runs.append(
                {
                    "prefill_ms": 1000 * prefill,
                    "decode_ms_per_step": 1000 * decode,
                    "output_tokens_per_s": ns.batch_size * ns.output_len / total,
                    "decode_tokens_per_s": ns.batch_size / decode,
                }
            )
        best = min(runs, key=lambda r: r["decode_ms_per_step"])
        print(
            f"Loom latency ({info['device']}, {info['dtype']}, {info['attention_backend']}, "
            f"cuda graphs {'on' if info.get('cuda_graphs') else 'off'}"
            f"{', torch.compile' if server_kwargs.get('enable_torch_compile') else ''}): batch "
            f"{ns.batch_size}, in {ns.input_len} / out {ns.output_len}"
        )
        print(
            f"  prefill {best['prefill_ms']:.1f} ms, decode {best['decode_ms_per_step']:.2f} "
            f"ms/step = {best['decode_tokens_per_s']:.1f} tokens/s, end to end "
            f"{best['output_tokens_per_s']:.1f} output tokens/s"
        )
        append_result(
            ns.result_file,
            {
                "bench": "latency",
                "batch_size": ns.batch_size,
                "input_len": ns.input_len,
                "output_len": ns.output_len,
                "device": info["device"],
                "dtype": info["dtype"],
                "attention_backend": info["attention_backend"],
                "model": info["model"],
                "cuda_graphs": info.get("cuda_graphs"),
                "torch_compile": bool(server_kwargs.get("enable_torch_compile")),
                "quantization": server_kwargs.get("quantization"),
                **best,
            },
        )
    return 0
