"""Where the scheduler's host time goes in a serving-like load: RUNNING requests decode while a
new request arrives every EVERY steps, the scheduler stepped on this thread under cProfile.

python bench/mixed_step_profile.py CONFIG.json [--steps N] [--running R] [--every K]
    [--kernels] [-- extra engine flags as key=value, e.g. enable_mixed_chunk=1 chunked_prefill_size=256]

Prints each kind of step's p50 / p99 host time (the scheduler's histograms) and the functions
with the most cumulative time; with ``--kernels`` (CUDA), instead of cProfile the torch profiler
records the steps' kernels, printed by total device time per step beside the wall time; with
``--sync-debug`` (CUDA) the steps run under ``torch.cuda.set_sync_debug_mode("warn")`` and each
distinct place in Loom that synchronised with the device is printed once.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
import traceback
import warnings

import torch
from gpu_kernel_profile import _kernels, _value  # (run as a script: this folder is on sys.path)

from loom.config import ServerArgs
from loom.engine.backends import _build_scheduler
from loom.sampling.sampling_params import SamplingParams
from loom.scheduler.messages import GenerateRequest
from loom.scheduler.request import Req
from loom.scheduler.stats import hist_quantile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--sort", default="cumulative", help="cProfile order: cumulative or tottime")
    p.add_argument("--kernels", action="store_true")
    p.add_argument("--sync-debug", action="store_true")
    p.add_argument("flags", nargs="*", help="engine arguments as key=value")
    ns = p.parse_intermixed_args()
    kw = dict(model=ns.model, load_format="dummy", skip_tokenizer_init=True)
    kw.update({k: _value(v) for k, v in (f.split("=", 1) for f in ns.flags)})
    args = ServerArgs(**kw)
    _, sched, info = _build_scheduler(args, set())
    rng = random.Random(0)
    vocab = info["vocab_size"]
    count = 0

    def add(out_len: int) -> None:
        nonlocal count
        ids = [rng.randrange(vocab) for _ in range(ns.input_len)]
        params = SamplingParams(max_new_tokens=out_len, ignore_eos=True, temperature=0.0)
        sched.add_request(Req.from_message(GenerateRequest(f"r{count}", ids, params)))
        count += 1

    for _ in range(ns.running):
        add(10 * ns.output_len)  # long-running: they decode through the whole profile
    while sched.prefill.waiting or sched.prefill.chunked_req is not None:
        sched.step()
    sched.stats.reset()
    if ns.sync_debug:
        seen: dict[tuple, int] = {}

        def show(message, *args, **kw) -> None:
            frames = tuple(
                f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()[:-1]
                if "/loom/" in f.filename
            )
            seen[frames] = seen.get(frames, 0) + 1

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for step in range(ns.steps):
            if step % ns.every == 0:
                add(ns.output_len)
            sched.step()
        torch.cuda.set_sync_debug_mode("default")
        for frames, count in sorted(seen.items(), key=lambda kv: -kv[1]):
            print(f"{count} synchronising calls at:")
            for f in frames[-6:]:
                print(f"    {f}")
        return
    if ns.kernels:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kp:
            t = time.perf_counter()
            for step in range(ns.steps):
                if step % ns.every == 0:
                    add(ns.output_len)
                sched.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    else:
        prof = cProfile.Profile()
        prof.enable()
        for step in range(ns.steps):
            if step % ns.every == 0:
                add(ns.output_len)
            sched.step()
        prof.disable()
    st = sched.stats
    for kind in ("decode", "prefill", "mixed"):
        h = getattr(st, f"step_hist_{kind}")
        if sum(h):
            print(
                f"{kind:>8} steps: {sum(h)}, p50 {1000 * hist_quantile(h, 0.5):.2f} ms, "
                f"p99 {1000 * hist_quantile(h, 0.99):.2f} ms"
            )
    if not ns.kernels:
        pstats.Stats(prof).sort_stats(ns.sort).print_stats(ns.top)
        return
    by_name = _kernels(kp)
    total = sum(sum(v) for v in by_name.values())
    print(
        f"wall {1000 * wall / ns.steps:.2f} ms a step, kernels {total / 1000 / ns.steps:.2f} ms "
        f"a step ({ns.steps} steps)"
    )
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: ns.top]:
        print(
            f"  {sum(times) / 1000 / ns.steps:8.3f} ms a step {len(times):7d} x "
            f"{sum(times) / len(times):8.2f} us  {name[:100]}"
        )


if __name__ == "__main__":
    main()
