"""``loom bench lora``: time to first token of a request by where its adapter is when it
arrives: on the device (in a slot), in host memory (copied into a slot first), or on disk (read,
checked and laid out first, then copied), against the base model.

Single requests, one at a time, cycle over the ``--lora-paths`` adapters, each asked for twice
in a row; the server's own flags (``--max-loras-per-batch``, ``--max-loaded-loras``) decide
where each adapter is. Each request is classed by what the engine did for it: a disk read, else
a slot load, else neither. Every prompt is new, so no request reuses cached KV.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from loom.bench import append_result
from loom.bench.workload import make_requests


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--rounds", type=int, default=4, help="passes over the adapters")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--result-file", default=None)


def run_lora(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    from loom.engine.engine import Engine
    from loom.lora.registry import parse_lora_paths

    names = [r.lora_name for r in parse_lora_paths(server_kwargs.get("lora_paths"))]
    if not names:
        raise ValueError("loom bench lora needs adapters: --lora-paths")
    order = [n for _ in range(ns.rounds) for n in names for _ in range(2)]
    base_runs = 2 * ns.rounds
    with Engine(backend="thread", **server_kwargs) as engine:
        info = engine.get_server_info()
        prompts = make_requests(
            len(order) + base_runs + 1, ns.input_len, 1, 1.0, engine.vocab_size, ns.seed
        )
        manager = engine.runner.lora_manager
        params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts[0][0], sampling_params=params)  # first-call costs
        ttft: dict[str, list[float]] = {"base": [], "device": [], "host": [], "disk": []}
        for i in range(base_runs):
            out = engine.generate(input_ids=prompts[1 + i][0], sampling_params=params)
            ttft["base"].append(out["meta_info"]["ttft"])
        for i, name in enumerate(order):
            reads, loads = manager.loader.num_disk_reads, manager.num_slot_loads
            out = engine.generate(
                input_ids=prompts[1 + base_runs + i][0], sampling_params=params, lora_path=name
            )
            if manager.loader.num_disk_reads > reads:
                where = "disk"
            elif manager.num_slot_loads > loads:
                where = "host"
            else:
                where = "device"
            ttft[where].append(out["meta_info"]["ttft"])
    row_mb = manager.layout.numel * manager.pool.element_size() / 2**20
    result: dict[str, Any] = {
        "bench": "lora_ttft",
        "device": info["device"],
        "dtype": info["dtype"],
        "input_len": ns.input_len,
        "adapters": len(names),
        "adapter_row_mib": round(row_mb, 1),
        "max_loras_per_batch": manager.num_slots,
        "max_loaded_loras": manager.loader.max_loaded,
    }
    print(
        f"LoRA time to first token ({info['device']}, {info['dtype']}, {ns.input_len}-token "
        f"prompts, adapter row {row_mb:.1f} MiB):"
    )
    for where, times in ttft.items():
        if times:
            med = statistics.median(times) * 1e3
            result[f"ttft_{where}_ms"] = med
            result[f"n_{where}"] = len(times)
            print(f"  {where:<7} {len(times):3d} requests, median {med:8.1f} ms")
        else:
            print(f"  {where:<7}   0 requests")
    append_result(ns.result_file, result)
    return 0
