"""Where a decode step's time goes on the GPU: the captured graph alone vs the whole step.

python bench/gpu_step_profile.py CONFIG.json [BATCH]   (dummy weights, bf16)
"""

from __future__ import annotations

import sys
import time

import torch

import loom


def main() -> None:
    config, bs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with loom.Engine(
        model=config, load_format="dummy", skip_tokenizer_init=True, max_running_requests=max(bs, 1)
    ) as e:
        ids = [[1000 + i] * 128 for i in range(bs)]
        params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
        e.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 8})
        t = time.perf_counter()
        outs = e.generate(input_ids=ids, sampling_params=params)
        total = time.perf_counter() - t
        tpot = (
            sum((o["meta_info"]["e2e_latency"] - o["meta_info"]["ttft"]) / 199 for o in outs) / bs
        )
        graphs = e.runner.cuda_graph_runner
        g = graphs.graphs[
            graphs.buckets[0] if bs == 1 else min(b for b in graphs.buckets if b >= bs)
        ]
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            g.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t) / 100
        print(
            f"batch {bs}: whole step {1000 * tpot:.2f} ms (TPOT), graph replay alone "
            f"{1000 * replay:.2f} ms, host overhead ~{1000 * (tpot - replay):.2f} ms; "
            f"{bs * 200 / total:.1f} output tokens/s"
        )


if __name__ == "__main__":
    main()
