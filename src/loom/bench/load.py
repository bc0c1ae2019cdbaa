"""``loom bench load``: load time and peak memory of each ``--load-format`` (and
``--quantization``) on one model, each load in a fresh process.

Peak memory is what loading adds to the process: on CUDA ``torch.cuda.max_memory_allocated``
over the load; on the CPU the peak resident set (``VmHWM``, reset through ``clear_refs``
before the load) minus the resident set before it. ``weights`` is the bytes of the loaded
model's parameters and buffers, so ``peak / weights`` near 1 means the load held little beside
the result. The child runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB: every
large buffer is its own mapping and is returned when freed, so the resident set follows what
the load holds rather than what the allocator kept after a transient (glibc otherwise raises
its threshold after the first large free and serves later buffers from a heap it seldom
trims).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from loom.bench import append_result


def add_load_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument(
        "--load-formats",
        default="auto,layered",
        help="comma-separated --load-format values, each loaded in its own process",
    )
    g.add_argument("--result-file", default=None)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_here(server_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Load the model in this process and measure it (``server_kwargs``: ServerArgs fields)."""
    import torch

    from loom.config import ServerArgs
    from loom.model_executor.model_runner import resolve_device, resolve_dtype
    from loom.model_executor.weights import model_config_for
    from loom.model_loader.base import DeviceConfig, resolve_model_class

    args = ServerArgs(**server_kwargs)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    # imports and config before the baseline: the figures are the load's alone
    loader, model_config = model_config_for(args, dtype)
    resolve_model_class(model_config.architecture, model_config.model_impl)
    import safetensors.torch  # noqa: F401
    import tqdm.auto  # noqa: F401

    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        before = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    model = loader.load_model(model_config, DeviceConfig(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _status_kib("VmHWM") * 1024 - before
    tensors = list(model.parameters()) + list(model.buffers())
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    return {
        "load_format": args.load_format,
        "quantization": args.quantization,
        "device": str(device),
        "load_s": seconds,
        "peak_bytes": peak,
        "weights_bytes": weights,
    }


def measure(server_kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure_here` in a fresh Python process."""
    out = subprocess.run(
        [sys.executable, "-m", "loom.bench.load", json.dumps(server_kwargs)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"loading {server_kwargs} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_load(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    rows = []
    for fmt in ns.load_formats.split(","):
        row = measure({**server_kwargs, "load_format": fmt})
        rows.append(row)
        append_result(ns.result_file, {"bench": "load", "model": server_kwargs["model"], **row})
    print(f"Loom load ({server_kwargs['model']}, quantization {rows[0]['quantization']}):")
    for r in rows:
        print(
            f"  {r['load_format']:>12}: {r['load_s']:.2f} s, peak {r['peak_bytes'] / 2**20:.0f} "
            f"MiB for {r['weights_bytes'] / 2**20:.0f} MiB of weights "
            f"({r['peak_bytes'] / max(r['weights_bytes'], 1):.2f}x)"
        )
    return 0


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))))
