"""``loom bench serving``: real HTTP streaming requests (SGLang's /generate) against a running
server, arriving as a Poisson process at a given rate; prints throughput and latency figures."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from loom.bench import append_result
from loom.bench.offline import make_requests


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson arrivals); inf sends all at once",
    )
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-file", default=None, help="append a JSON line with the results")


async def _one(client, url: str, ids: list[int], n_out: int, headers: dict) -> dict[str, Any]:
    import httpx

    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True},
    }
    start = time.perf_counter()
    times: list[float] = []
    count, error = 0, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # the request failed after its stream started
                        error = f"error event: {chunk['error'].get('message')}"
                        continue
                    new = len(chunk["output_ids"]) - count
                    if new > 0:
                        now = time.perf_counter()
                        times.extend([now] * new)
                        count += new
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {
        "start": start,
        "end": end,
        "token_times": times,
        "error": error,
        "output_tokens": count,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def run_serving(ns: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with httpx.Client(base_url=ns.base_url, headers=headers, timeout=30) as c:
        info = c.get("/server_info").json()
    reqs = make_requests(
        ns.num_prompts,
        ns.random_input_len,
        ns.random_output_len,
        ns.random_range_ratio,
        info["vocab_size"],
        ns.seed,
    )

    async def main():
        rng = random.Random(ns.seed)
        sem = asyncio.Semaphore(ns.max_concurrency or len(reqs))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=ns.base_url, timeout=None, limits=limits) as client:

            async def bounded(ids, n):
                async with sem:
                    return await _one(client, "/generate", ids, n, headers)

            tasks = []
            for ids, n in reqs:
                tasks.append(asyncio.create_task(bounded(ids, n)))
                if ns.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(ns.request_rate))
            return await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    ok = [r for r in results if r["error"] is None and r["token_times"]]
    errors = [r["error"] for r in results if r["error"] is not None]
    ttft = [r["token_times"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["token_times"], r["token_times"][1:], strict=False)]
    e2e = [r["end"] - r["start"] for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    summary = {
        "request_rate": ns.request_rate,
        "num_prompts": ns.num_prompts,
        "input_len": ns.random_input_len,
        "output_len": ns.random_output_len,
        "completed": len(ok),
        "errors": len(errors),
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": out_tokens / elapsed,
        **{
            f"{name}_{stat}_ms": 1000 * fn(vals)
            for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e))
            for stat, fn in (
                ("mean", lambda v: statistics.fmean(v) if v else float("nan")),
                ("p50", lambda v: _pct(v, 50)),
                ("p99", lambda v: _pct(v, 99)),
            )
        },
    }
    print(
        f"{'request rate':<28}{ns.request_rate} req/s   ({info.get('device')}, {info.get('dtype')})"
    )
    print(f"{'completed / errors':<28}{len(ok)} / {len(errors)} in {elapsed:.2f} s")
    print(f"{'request throughput':<28}{summary['request_throughput']:.2f} req/s")
    print(f"{'output token throughput':<28}{summary['output_throughput']:.1f} tokens/s")
    for name in ("ttft", "itl", "e2e"):
        print(
            f"{name.upper() + ' mean / p50 / p99':<28}"
            f"{summary[name + '_mean_ms']:.1f} / {summary[name + '_p50_ms']:.1f} / "
            f"{summary[name + '_p99_ms']:.1f} ms"
        )
    for e in errors[:3]:
        print("error:", e)
    append_result(ns.result_file, summary)
    return 0 if not errors else 1
