"""llama.cpp on the same GGUF file, as the CPU peer of ``loom bench latency`` at batch 1: the
decode rate (llama.cpp's own eval timings) of OUTPUT_LEN tokens after a prompt of INPUT_LEN
random ids, best of RUNS.

    python bench/llama_cpp_peer.py GGUF [--input-len 32] [--output-len 128] [--runs 3]
        [--threads N]

Needs ``llama-cpp-python`` (built from source here: ``pip install llama-cpp-python`` in a
virtual environment of its own, which compiles llama.cpp for this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from llama_cpp import Llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    ns = p.parse_args()
    llm = Llama(ns.model, n_ctx=1024, n_threads=ns.threads, n_batch=512, verbose=False)
    rng = random.Random(0)
    best = None
    for _ in range(ns.runs):
        prompt = [rng.randrange(100, llm.n_vocab()) for _ in range(ns.input_len)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(ns.output_len):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        decode = time.perf_counter() - start
        rate = ns.output_len / decode
        if best is None or rate > best["decode_tokens_per_s"]:
            best = {"prefill_s": prefill, "decode_s": decode, "decode_tokens_per_s": rate}
    print(json.dumps({"peer": "llama.cpp", "threads": ns.threads, **best}))


if __name__ == "__main__":
    main()
