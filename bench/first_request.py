"""What a fresh engine's first requests pay after its start-up warm-up: each of a few identical
batch-1 requests is timed (prefill to last token), and with a fresh ``TRITON_CACHE_DIR`` the
Triton kernels compiled during each request are listed by name. A kernel listed under a request
is one the warm-up (``Scheduler.warmup``) did not reach.

TRITON_CACHE_DIR=/tmp/tc-fresh python bench/first_request.py [--model configs/smollm2-135m.json]
    [--input-len 124] [--output-len 256] [--repeat 3] [--result-file F]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import loom
from loom.bench import append_result


def compiled(cache: pathlib.Path | None) -> set[str]:
    """Names of the Triton kernels in the cache (one ``<name>.json`` per compiled variant)."""
    if cache is None or not cache.is_dir():
        return set()
    return {
        f"{p.parent.name[:8]}/{p.stem}" for p in cache.glob("*/*.json") if "__grp__" not in p.name
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="configs/smollm2-135m.json")
    p.add_argument("--input-len", type=int, default=124)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--result-file", default=None)
    ns = p.parse_args()
    cache = os.environ.get("TRITON_CACHE_DIR")
    cache = pathlib.Path(cache) if cache else None
    t0 = time.perf_counter()
    with loom.Engine(
        model=ns.model, load_format="dummy", skip_tokenizer_init=True, max_running_requests=1
    ) as e:
        start_s = time.perf_counter() - t0
        seen = compiled(cache)
        vocab = e.vocab_size
        rows = []
        for i in range(ns.repeat):
            ids = [(11 + 17 * (k + i)) % vocab for k in range(ns.input_len)]
            t = time.perf_counter()
            out = e.generate(
                input_ids=ids,
                sampling_params={"max_new_tokens": ns.output_len, "ignore_eos": True},
            )
            dt = time.perf_counter() - t
            now = compiled(cache)
            rows.append(
                {
                    "seconds": dt,
                    "tokens_per_s": len(out["output_ids"]) / dt,
                    "compiled": sorted(now - seen),
                }
            )
            seen = now
            print(
                f"request {i}: {dt * 1e3:.1f} ms, {rows[-1]['tokens_per_s']:.1f} tok/s, "
                f"compiled {rows[-1]['compiled']}"
            )
    result = {
        "bench": "first_request",
        "model": ns.model,
        "engine_start_s": start_s,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "requests": rows,
    }
    print(json.dumps(result))
    append_result(ns.result_file, result)


if __name__ == "__main__":
    main()
