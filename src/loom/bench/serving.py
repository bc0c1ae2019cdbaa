"""``loom bench serving``: streaming requests against a running server from several worker
processes (``serving_client.py``), arriving as a Poisson process at a given rate or all at once.

It prints throughput and latency, where the server's time went over the run (the server's
``profile`` counters in ``/server_info``, read before and after), and whether the client itself
was the limit: each worker's CPU use and event-loop lag, and with ``--scaling-check`` the same
run again with twice the workers.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import time
from typing import Any

from loom.bench import append_result
from loom.bench.serving_client import ENDPOINTS, WorkerSpec, WorkItem, worker_main
from loom.bench.workload import arrival_offsets, make_requests
from loom.scheduler.stats import hist_delta, hist_quantile

# SGLang's bench_serving names for the same endpoints
_ALIASES = {"sglang": "generate", "sglang-oai": "completions", "sglang-oai-chat": "chat"}
# A worker busier than this share of a core, or whose loop wakes this late, limited the run.
_BUSY_CPU = 0.85
_LATE_LOOP_S = 0.010


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument(
        "--backend",
        default="generate",
        choices=(*ENDPOINTS, *_ALIASES),
        help="generate: SGLang's /generate; completions: /v1/completions; chat: "
        "/v1/chat/completions (SGLang's names sglang, sglang-oai, sglang-oai-chat also work)",
    )
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
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (split evenly over the workers)",
    )
    p.add_argument(
        "--num-workers", type=int, default=1, help="client processes sending the requests"
    )
    p.add_argument(
        "--scaling-check",
        action="store_true",
        help="run again with twice the workers (after flushing the server's prefix cache) and "
        "report what that changed",
    )
    p.add_argument(
        "--flush-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="empty the server's prefix cache before each run, so an earlier run's prompts are "
        "not served from it",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for the chat backend's prompt texts (default: the server's)",
    )
    p.add_argument(
        "--tool-choice",
        choices=("required", "named"),
        default=None,
        help="chat backend: each request offers two tools (a weather and a time lookup) and "
        "forces a call, required or to get_weather by name (the grammar backend constrains "
        "the output); compare with the same run without it",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-file", default=None, help="append a JSON line with the results")


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }


def tool_fields(choice: str) -> dict[str, Any]:
    """A chat request's ``tools`` and ``tool_choice`` for ``--tool-choice``."""
    tools = [
        _tool(
            "get_weather",
            "The weather in a city.",
            {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        ),
        _tool("get_time", "The time in a zone.", {"zone": {"type": "string", "maxLength": 16}}),
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    return {"tools": tools, "tool_choice": named if choice == "named" else "required"}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _texts(ns: argparse.Namespace, info: dict[str, Any], reqs: list) -> list[str]:
    """Chat prompts: the random ids decoded by the server's tokenizer (or ``--tokenizer``)."""
    from loom import plugins

    plugins.ensure_loaded()
    loader = plugins.resolve("model_loader", info.get("load_format") or "auto")()
    path = ns.tokenizer or info.get("tokenizer_path") or info["model_path"]
    tok = loader.load_tokenizer(path)
    if tok is None:
        raise SystemExit(f"the chat backend needs a tokenizer; none found at {path} (--tokenizer)")
    return [tok.decode(ids) for ids, _ in reqs]


def _run_once(
    ns: argparse.Namespace, info: dict[str, Any], items: list[WorkItem], workers: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Send ``items`` from ``workers`` processes; returns (per-request results, per-worker
    figures, elapsed seconds)."""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    per_worker_conc = math.ceil(ns.max_concurrency / workers) if ns.max_concurrency else None
    endpoint = _ALIASES.get(ns.backend, ns.backend)
    model = info.get("served_model_name") or info.get("model")
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    extra = {}
    if ns.tool_choice is not None:
        if endpoint != "chat":
            raise SystemExit("--tool-choice needs --backend chat")
        extra = tool_fields(ns.tool_choice)
    for w in range(workers):
        spec = WorkerSpec(
            ns.base_url, endpoint, model, headers, items[w::workers], per_worker_conc, extra
        )
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(spec, theirs), daemon=True)
        proc.start()
        conns.append(mine)
        procs.append(proc)
    try:
        for c in conns:
            c.recv()  # started, libraries imported: start-up is not timed
        start_at = time.monotonic() + 0.2
        for c in conns:
            c.send(start_at)
        outs = [c.recv() for c in conns]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    elapsed = max(r["end"] for o in outs for r in o["results"]) - start_at if items else 0.0
    results = sorted((r for o in outs for r in o["results"]), key=lambda r: r["index"])
    return results, outs, elapsed


def _summarize(results, outs, elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None and r["chunk_times"]]
    errors = [r["error"] for r in results if r["error"] is not None]
    ttft = [r["chunk_times"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:], strict=False)]
    e2e = [r["end"] - r["start"] for r in ok]
    tpot = [
        (r["chunk_times"][-1] - r["chunk_times"][0]) / (r["output_tokens"] - 1)
        for r in ok
        if r["output_tokens"] > 1
    ]
    out_tokens = sum(r["output_tokens"] for r in ok)
    chunks = sum(len(r["chunk_times"]) for r in ok)
    lags = [x for o in outs for x in o["loop_lag_s"]]
    cpu = [o["cpu_s"] / max(o["wall_s"], 1e-9) for o in outs]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "errors": len(errors),
        "error_messages": errors[:3],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_throughput": out_tokens / elapsed if elapsed else 0.0,
        "input_tokens": sum(r["prompt_tokens"] for r in ok),
        "output_tokens": out_tokens,
        "tokens_per_chunk": out_tokens / chunks if chunks else float("nan"),
        "client_cpu": cpu,  # each worker's CPU seconds per second of the run
        "client_loop_lag_p99_ms": 1000 * _pct(lags, 99),
        "client_loop_lag_max_ms": 1000 * max(lags) if lags else float("nan"),
    }
    for name, vals in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        summary[f"{name}_mean_ms"] = 1000 * statistics.fmean(vals) if vals else float("nan")
        summary[f"{name}_p50_ms"] = 1000 * _pct(vals, 50)
        summary[f"{name}_p99_ms"] = 1000 * _pct(vals, 99)
    summary["client_limited"] = bool(
        max(cpu, default=0) > _BUSY_CPU or summary["client_loop_lag_p99_ms"] > 1000 * _LATE_LOOP_S
    )
    return summary


# (stage, the count it is divided by) in the server's profile
STAGES = (
    ("output_message", "output_messages"),
    ("receive", "output_messages"),
    ("apply", "outputs"),
    ("detokenize", "detokenized_tokens"),
    ("sse", "sse_events"),
)


def server_profile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Per-process CPU use and per-item front-end costs between two ``profile`` snapshots."""
    wall = after["wall_s"] - before["wall_s"]
    if wall <= 0:
        return {}
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
    out: dict[str, Any] = {"wall_s": wall}
    for name in ("receive", "deliver"):
        key = f"handover_{name}_hist"
        if key in after:
            h = hist_delta(after[key], before.get(key))
            out[f"handover_{name}_p50_ms"] = 1000 * hist_quantile(h, 0.5)
            out[f"handover_{name}_p99_ms"] = 1000 * hist_quantile(h, 0.99)
    for proc in ("front", "scheduler"):
        if f"{proc}_cpu_s" in d:
            out[f"{proc}_cpu"] = d[f"{proc}_cpu_s"] / wall
    for stage, count in STAGES:
        out[count] = d.get(count, 0)
        if d.get(count):
            out[f"{stage}_us"] = 1e6 * d[f"{stage}_s"] / d[count]
            out[f"{stage}_share"] = d[f"{stage}_s"] / wall  # of one core
    return out


def _server_infos(client, count: int) -> dict[int, dict[str, Any]]:
    """``/server_info`` of each of the server's ``count`` front-end processes, by index (each
    asked on a new connection, which the kernel hands to one of them); {} if the server is
    gone."""
    import httpx

    infos: dict[int, dict[str, Any]] = {}
    for _ in range(1 if count == 1 else 32 * count):
        try:
            if count == 1:
                info = client.get("/server_info").json()
            else:
                info = httpx.get(
                    f"{client.base_url}/server_info", headers=client.headers, timeout=60
                ).json()
        except httpx.HTTPError:
            return infos
        infos.setdefault(info.get("front_end", 0), info)
        if len(infos) == count:
            break
    return infos


def _flush(client) -> None:
    """Empty the server's prefix cache (it flushes once no request is running)."""
    client.post("/flush_cache")
    for _ in range(100):
        info = client.get("/server_info").json()
        if info.get("kv_cached_pages", 0) == 0 and info.get("num_running_reqs", 0) == 0:
            return
        time.sleep(0.1)
        client.post("/flush_cache")


def _engine_delta(before: dict[str, Any], after: dict[str, Any], elapsed: float) -> dict:
    """The engine's own figures over the run, from the scheduler's counters in server info:
    its steps, and the mean time a step took (the time between two tokens of a request that
    every step decodes)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
    steps = d.get("num_decode_batches", 0) + d.get("num_prefill_batches", 0)
    if not steps:
        return {}
    stepping = d.get("time_decode_s", 0) + d.get("time_prefill_s", 0)
    out = {
        "decode_steps": d["num_decode_batches"],
        "prefill_steps": d["num_prefill_batches"],
        "mean_decode_batch": d["num_decode_tokens"] / max(1, d["num_decode_batches"]),
        "step_ms": 1000 * stepping / steps,
        # the share of the run the scheduler spent in steps (it steps while any request runs)
        "stepping": stepping / elapsed if elapsed else float("nan"),
    }
    if d.get("time_device_decode_s") and elapsed:  # CUDA: the device's time in steps
        out["device_decode_busy"] = d["time_device_decode_s"] / elapsed
        out["device_busy"] = (
            d["time_device_decode_s"] + d.get("time_device_prefill_s", 0)
        ) / elapsed
    out["triton_compiles"] = d.get("num_triton_compiles", 0)
    out["triton_compile_ms"] = 1000 * d.get("time_triton_compile_s", 0.0)
    # each kind of step's host time: count, p50, p99 (ms)
    for kind in ("decode", "prefill", "mixed"):
        key = f"step_hist_{kind}"
        if key in after:
            h = hist_delta(after[key], before.get(key))
            out[f"{kind}_step_count"] = sum(h)
            out[f"{kind}_step_p50_ms"] = 1000 * hist_quantile(h, 0.5)
            out[f"{kind}_step_p99_ms"] = 1000 * hist_quantile(h, 0.99)
    return out


def _report(ns, info, summary: dict[str, Any], workers: int) -> None:
    print(
        f"{'backend / workers':<28}{ns.backend} / {workers}"
        f"{f', tool_choice {ns.tool_choice}' if ns.tool_choice else ''}   "
        f"({info.get('device')}, {info.get('dtype')}, {ns.request_rate} req/s)"
    )
    print(
        f"{'completed / errors':<28}{summary['completed']} / {summary['errors']} in "
        f"{summary['duration_s']:.2f} s"
    )
    print(f"{'request throughput':<28}{summary['request_throughput']:.2f} req/s")
    print(f"{'output token throughput':<28}{summary['output_throughput']:.1f} tokens/s")
    for name in ("ttft", "itl", "tpot", "e2e"):
        print(
            f"{name.upper() + ' mean / p50 / p99':<28}"
            f"{summary[name + '_mean_ms']:.1f} / {summary[name + '_p50_ms']:.1f} / "
            f"{summary[name + '_p99_ms']:.1f} ms"
        )
    print(f"{'tokens per stream event':<28}{summary['tokens_per_chunk']:.2f}")
    cpu = " ".join(f"{c:.0%}" for c in summary["client_cpu"])
    print(
        f"{'client CPU per worker':<28}{cpu}   loop lag p99 "
        f"{summary['client_loop_lag_p99_ms']:.1f} ms, max {summary['client_loop_lag_max_ms']:.1f}"
    )
    print(
        f"{'client the limit?':<28}"
        + (
            "likely: a worker was busy or its loop ran late; add --num-workers"
            if summary["client_limited"]
            else "no: every worker had spare CPU and its loop woke on time"
        )
    )
    eng = summary.get("engine")
    if eng:
        print(
            f"{'engine steps':<28}{eng['decode_steps']} decode (mean batch "
            f"{eng['mean_decode_batch']:.1f}) + {eng['prefill_steps']} prefill, "
            f"{eng['step_ms']:.2f} ms a step, stepping {eng['stepping']:.0%} of the run"
            + (
                f", the device busy with decode steps {eng['device_decode_busy']:.0%}"
                if "device_decode_busy" in eng
                else ""
            )
        )
        for kind in ("decode", "prefill", "mixed"):
            if eng.get(f"{kind}_step_count"):
                print(
                    f"{'  ' + kind + ' steps p50 / p99':<28}{eng[kind + '_step_p50_ms']:.2f} / "
                    f"{eng[kind + '_step_p99_ms']:.2f} ms (x {eng[kind + '_step_count']}, "
                    "bucket upper edges)"
                )
        if eng.get("triton_compiles"):
            print(
                f"{'Triton compiles':<28}{eng['triton_compiles']} while serving, "
                f"{eng['triton_compile_ms']:.0f} ms in all"
            )
        if "device_busy" in eng:
            print(f"{'device busy':<28}{eng['device_busy']:.0%} of the run (decode and prefill)")
        print(f"{'ITL p99 / engine step':<28}{summary['itl_p99_ms'] / eng['step_ms']:.1f}")
        if eng.get("decode_step_count"):
            print(
                f"{'ITL p99 / decode step p50':<28}"
                f"{summary['itl_p99_ms'] / eng['decode_step_p50_ms']:.1f}"
            )
    fronts = summary.get("front_ends") or (
        {"0": summary["server"]} if summary.get("server") else {}
    )
    if fronts:
        cpu = [
            f"front{'' if len(fronts) == 1 else ' ' + i} {p['front_cpu']:.0%}"
            for i, p in fronts.items()
            if "front_cpu" in p
        ]
        sched = next(iter(fronts.values())).get("scheduler_cpu")
        if sched is not None:
            cpu.append(f"scheduler {sched:.0%}")
        print(f"{'server CPU per process':<28}{', '.join(cpu)}")
    for i, prof in fronts.items():
        if len(fronts) > 1:
            print(f"{'front end ' + i:<28}")
        if "handover_deliver_p99_ms" in prof:
            print(
                f"{'  hand-over p50 / p99':<28}received {prof['handover_receive_p50_ms']:.2f} / "
                f"{prof['handover_receive_p99_ms']:.2f} ms, on the event loop "
                f"{prof['handover_deliver_p50_ms']:.2f} / {prof['handover_deliver_p99_ms']:.2f} ms "
                "after the scheduler emitted"
            )
        for stage, count in STAGES:
            if stage + "_us" in prof:
                print(
                    f"{'  ' + stage:<28}{prof[stage + '_us']:.1f} us x {prof[count]} "
                    f"({prof[stage + '_share']:.0%} of a core)"
                )
    for e in summary["error_messages"]:
        print("error:", e)


def run_serving(ns: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    client = httpx.Client(base_url=ns.base_url, headers=headers, timeout=60)
    info = client.get("/server_info").json()
    reqs = make_requests(
        ns.num_prompts,
        ns.random_input_len,
        ns.random_output_len,
        ns.random_range_ratio,
        info["vocab_size"],
        ns.seed,
    )
    endpoint = _ALIASES.get(ns.backend, ns.backend)
    payloads = _texts(ns, info, reqs) if endpoint == "chat" else [ids for ids, _ in reqs]
    offsets = arrival_offsets(len(reqs), ns.request_rate, ns.seed)
    items = [
        WorkItem(i, p, n, t)
        for i, (p, (_, n), t) in enumerate(zip(payloads, reqs, offsets, strict=True))
    ]
    base = {
        "backend": endpoint,
        "request_rate": ns.request_rate,
        "num_prompts": ns.num_prompts,
        "input_len": ns.random_input_len,
        "output_len": ns.random_output_len,
        "tool_choice": ns.tool_choice,
    }
    runs = [ns.num_workers] + ([2 * ns.num_workers] if ns.scaling_check else [])
    failed = False
    first = None
    for k, workers in enumerate(runs):
        if ns.flush_cache:
            _flush(client)
        fronts = info.get("front_ends", 1)
        befores = _server_infos(client, fronts)
        results, outs, elapsed = _run_once(ns, info, items, workers)
        afters = _server_infos(client, fronts)  # ({} if the server is gone: a shutdown under load)
        summary = {**base, "num_workers": workers, **_summarize(results, outs, elapsed)}
        both = sorted(set(befores) & set(afters))
        before, after = (befores[both[0]], afters[both[0]]) if both else ({}, {})
        summary["engine"] = _engine_delta(before, after, elapsed) if after else {}
        profiles = {
            i: server_profile_delta(befores[i]["profile"], afters[i]["profile"])
            for i in both
            if befores[i].get("profile") and afters[i].get("profile")
        }
        if profiles:
            summary["server"] = profiles[min(profiles)]
        if fronts > 1:
            summary["front_ends"] = {str(i): prof for i, prof in profiles.items()}
        _report(ns, info, summary, workers)
        if first is None:
            first = summary
        else:
            change = summary["output_throughput"] / max(first["output_throughput"], 1e-9) - 1
            summary["scaling_change"] = change
            print(
                f"{'twice the workers':<28}{change:+.1%} output throughput: the client "
                + ("was part of the limit" if change > 0.05 else "was not the limit")
            )
        append_result(ns.result_file, summary)
        failed |= summary["errors"] > 0
        if k + 1 < len(runs):
            print()
    client.close()
    return 1 if failed else 0
