"""Where a constrained decode step's time goes on the GPU: kernels, and the device's idle gaps.

python bench/structured_kprof.py CONFIG.json TOKENIZER_DIR [BATCH] [MAX_NEW_TOKENS] [k=v ...]

Dummy weights. One batch of ``BATCH`` greedy requests constrained by ``loom bench structured``'s
JSON schemas, then the same prompts free with the same output lengths (as that bench pairs
them), each run once to warm up and once under the torch profiler (CUDA activity only, so the
host is barely slowed). Per decode step of each run it prints the wall time (the scheduler's
decode time / steps), the device's busy time (the union of kernel and copy intervals), and its
idle gaps, each charged to the device activity that ended it: a gap before the first kernel of
the forward means the device waited for the forward's launch, one before the sampling kernels
or the mask's copy means it waited for the grammar's host work. The kernels whose per-step
time differs between the runs are listed too.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from gpu_kernel_profile import _value  # (bench/, this script's directory)
from torch.profiler import ProfilerActivity, profile

import loom
from loom.bench.offline import step_profile
from loom.bench.structured import schema_requests


def _device_activity(prof, device_type) -> list[tuple[float, float, str]]:
    """(start, end, name) of every kernel and copy the device ran, in start order (us)."""
    acts = []
    for ev in prof.events():
        if ev.device_type == device_type and ev.time_range.end > 0:
            acts.append((ev.time_range.start, ev.time_range.end, ev.name))
    acts.sort()
    return acts


def _summarise(acts, steps: int, gap_floor_us: float = 2.0):
    busy = 0.0
    gaps: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    reach = None  # the end of everything seen so far (activities may overlap on streams)
    for start, end, name in acts:
        kernels[name] += end - start
        if reach is None:
            busy += end - start
            reach = end
            continue
        if start > reach:
            if start - reach >= gap_floor_us:
                gaps[name] += start - reach
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    span = (acts[-1][1] - acts[0][0]) if acts else 0.0
    per = max(1, steps)
    return (
        span / per,
        busy / per,
        {k: v / per for k, v in gaps.items()},
        {k: v / per for k, v in kernels.items()},
    )


_DEVICE = {
    ProfilerActivity.CUDA: torch.autograd.DeviceType.CUDA,
    ProfilerActivity.CPU: torch.autograd.DeviceType.CPU,
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    # on a machine without CUDA this runs end to end with CPU activity (a check of the script)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    config, tok = sys.argv[1], sys.argv[2]
    bs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    n_out = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    kwargs = {k: _value(v) for k, v in (kv.split("=", 1) for kv in sys.argv[5:])}
    with loom.Engine(
        model=config,
        load_format="dummy",
        tokenizer_path=tok,
        max_running_requests=bs,
        **kwargs,
    ) as e:
        prompts, params = schema_requests(e, bs, n_out)

        def once(ps, profiled: bool):
            e.flush_cache()
            _sync()
            before = dict(e.get_server_info())
            if not profiled:
                outs = e.generate(input_ids=prompts, sampling_params=ps)
                return outs, step_profile(before, e.get_server_info()), None
            with profile(activities=[activity]) as prof:
                outs = e.generate(input_ids=prompts, sampling_params=ps)
                _sync()
            return outs, step_profile(before, e.get_server_info()), prof

        outs, _, _ = once(params, False)
        lens = [o["meta_info"]["completion_tokens"] for o in outs]
        free = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]
        once(free, False)
        results = {}
        for tag, ps in (("constrained", params), ("free", free)):
            _, st, prof = once(ps, True)
            steps = st["num_decode_batches"]
            # the prefill's kernels are in the trace too: leave the first forward's share out by
            # timing only what starts after the first token's copy to the host
            acts = _device_activity(prof, _DEVICE[activity])
            first_d2h = next(
                (i for i, a in enumerate(acts) if "DtoH" in a[2] or "Device -> Pinned" in a[2]), 0
            )
            results[tag] = (st, steps, _summarise(acts[first_d2h + 1 :], steps))
    print(f"{config} batch {bs}, output lengths {sorted(lens)}")
    for tag, (st, steps, (span, busy, gaps, _)) in results.items():
        wall = 1e6 * st["time_decode_s"] / max(1, steps)
        print(
            f"{tag}: {steps} decode steps, wall {wall:.1f} us a step (scheduler), device span "
            f"{span:.1f}, busy {busy:.1f}, idle {span - busy:.1f} us a step"
        )
        for name, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    idle before {name[:100]}: {us:.1f} us a step")
    con, free_k = results["constrained"][2][3], results["free"][2][3]
    print("kernels, us a step, constrained / free (the largest differences):")
    names = set(con) | set(free_k)
    diff = sorted(names, key=lambda n: -abs(con.get(n, 0.0) - free_k.get(n, 0.0)))
    for name in diff[:12]:
        print(f"    {con.get(name, 0.0):8.1f} / {free_k.get(name, 0.0):8.1f}  {name[:100]}")


if __name__ == "__main__":
    main()
