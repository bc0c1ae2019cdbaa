"""Which GPU kernels a workload runs and how long each takes (torch profiler / CUPTI).

python bench/gpu_kernel_profile.py CONFIG.json BATCH INPUT_LEN OUTPUT_LEN [engine kwargs as k=v]
    [--decode-only] [--sampling penalties]

Dummy weights, bf16. Runs the batch once to warm up, then again under the profiler, and prints
the kernels grouped by name (total device time, count, mean) per decode step and the sum, next
to the measured wall time per step, so the gap (launch gaps, host time) is visible. Kernels
inside CUDA graph replays are recorded too. ``--decode-only`` also profiles the batch with one
output token (its prefill and first sample) and subtracts it, kernel by kernel, so what is left
is the decode steps' alone. ``--sampling penalties``: every request samples with ``loom bench
offline``'s penalties preset (temperature, top_p, three penalties, a logit bias) instead of
greedily, to see which kernels a penalised step adds.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import loom


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _kernels(prof) -> dict[str, list[float]]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            by_name[ev.name].append(ev.device_time)  # microseconds
    return by_name


def _profiled(e, ids, params):
    e.flush_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        e.generate(input_ids=ids, sampling_params=params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return _kernels(prof), wall


def main() -> None:
    decode_only = "--decode-only" in sys.argv
    argv = [a for a in sys.argv if a != "--decode-only"]
    preset = "greedy"
    if "--sampling" in argv:
        at = argv.index("--sampling")
        preset = argv[at + 1]
        del argv[at : at + 2]
    config, bs, n_in, n_out = argv[1], *map(int, argv[2:5])
    kwargs = dict(kv.split("=", 1) for kv in argv[5:])
    kwargs = {k: _value(v) for k, v in kwargs.items()}
    if decode_only:
        # admit without reserving room for future tokens, so the 1-token and the long run
        # prefill in the same chunks and their prefill kernels cancel exactly
        kwargs.setdefault("schedule_conservativeness", 0.0)
    with loom.Engine(
        model=config,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_running_requests=max(bs, 1),
        **kwargs,
    ) as e:
        ids = [[1000 + (i * 7 + j) % 30000 for j in range(n_in)] for i in range(bs)]
        from loom.bench.offline import sampling_preset

        extra = sampling_preset(preset, e.vocab_size)
        params = {"max_new_tokens": n_out, "ignore_eos": True, **extra}
        e.generate(input_ids=ids, sampling_params=params)
        by_name, wall = _profiled(e, ids, params)
        if decode_only:  # minus the same batch's prefill and first token
            base, base_wall = _profiled(e, ids, {**params, "max_new_tokens": 1})
            wall -= base_wall
            for name, times in base.items():
                mine = by_name.get(name, [])
                left = sum(mine) - sum(times)
                count = max(1, len(mine) - len(times))
                by_name[name] = [left / count] * count if left > 0 else []
            by_name = {k: v for k, v in by_name.items() if v}
        info = e.get_server_info()
    total = sum(sum(v) for v in by_name.values())
    steps = max(1, n_out - 1)
    print(
        f"{config} batch {bs} in {n_in} out {n_out}, {preset} "
        f"({info['attention_backend']}, cuda graphs "
        f"{info.get('cuda_graphs')}): wall {1000 * wall:.1f} ms; kernels {total / 1000:.1f} ms "
        f"in all; per decode step (wall / {steps}) {1000 * wall / steps:.3f} ms"
    )
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[:30]:
        print(
            f"  {sum(times) / 1000:9.2f} ms {len(times):7d} x {sum(times) / len(times):8.2f} us"
            f"  {name[:110]}"
        )


if __name__ == "__main__":
    main()
