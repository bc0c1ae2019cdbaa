"""``loom bench structured``: the cost of constrained decoding.

1. Compile time: each of the 25 JSON schemas in ``loom.bench.json_schemas`` compiled by a fresh
   backend (cold cache), p50 / p99 / max in ms.
2. Decode throughput: ``--batch-size`` requests at a time, each constrained by one of the schemas,
   then the same prompts unconstrained with ``max_new_tokens`` set to what each constrained
   request produced (``ignore_eos``), so both runs decode the same number of tokens in the same
   batch shapes. Reports output tokens/s of both and the overhead, end to end and over the
   decode steps alone (the scheduler's step profile: decode tokens / time in decode steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from loom.bench import append_result
from loom.bench.offline import host_phases, step_profile


def add_structured_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--result-file", default=None)
    g.add_argument(
        "--engine-backend",
        choices=("thread", "process"),
        default="thread",
        help="process: the scheduler in a process of its own (as `loom serve` runs it), so "
        "this process's detokenising does not share its interpreter lock",
    )


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _finished_text(out: dict[str, Any]) -> str | None:
    """The text of an output that ended with a stop (the grammar's end), else None."""
    reason = out["meta_info"].get("finish_reason") or {}
    return out.get("text", "") if reason.get("type") == "stop" else None


def _parses(text: str) -> bool:
    # strict=False: xgrammar lets tokens carrying raw control characters into JSON strings
    # (random weights pick them; strict JSON forbids them), not a failure to constrain
    try:
        json.loads(text, strict=False)
    except ValueError:
        return False
    return True


def schema_requests(engine, n: int, max_new_tokens: int) -> tuple[list, list[dict[str, Any]]]:
    """``n`` chat prompts (token ids) asking for JSON, each with greedy sampling constrained by
    one of the 25 schemas in turn."""
    from loom.bench.json_schemas import SCHEMAS

    prompts, params = [], []
    for i in range(n):
        task, schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(
            engine.apply_chat_template(
                [{"role": "user", "content": f"{task} Answer with a JSON object only."}]
            )
        )
        params.append(
            {"max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": json.dumps(schema)}
        )
    return prompts, params


def run_structured(ns: argparse.Namespace, server_kwargs: dict[str, Any]) -> int:
    from loom.bench.json_schemas import SCHEMAS
    from loom.constrained.manager import build_grammar_backend
    from loom.engine.engine import Engine

    with Engine(backend=ns.engine_backend, **server_kwargs) as engine:
        args = engine.server_args
        info = engine.get_server_info()
        backend = build_grammar_backend(
            args.grammar_args, engine.tokenizer, engine.vocab_size, engine.eos_token_ids
        )
        compile_ms = []
        for _, schema in SCHEMAS:
            t = time.perf_counter()
            backend.compile("json_schema", json.dumps(schema))
            compile_ms.append(1000 * (time.perf_counter() - t))
        prompts, params = schema_requests(engine, ns.num_prompts, ns.max_new_tokens)
        # Warm-up: every schema compiles once (compile time is reported above; the grammar
        # cache then serves the timed run, as it serves repeated schemas in production). Then
        # the batch shapes of the timed run, constrained and free, once each: kernels that
        # specialise on the row count (the mask's apply kernel, Loom's own) compile here, not
        # inside the timed region.
        seen = {}
        for p, ps in zip(prompts, params, strict=True):
            seen.setdefault(ps["json_schema"], (p, {**ps, "max_new_tokens": 2}))
        warm = list(seen.values())
        engine.generate(input_ids=[p for p, _ in warm], sampling_params=[ps for _, ps in warm])
        free_warm = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        for n in sorted({ns.batch_size, 1}):
            for warm_params in ([{**ps, "max_new_tokens": 4} for ps in params[:n]], free_warm):
                engine.generate(input_ids=prompts[:n], sampling_params=warm_params)
        engine.flush_cache()

        done: list[str] = []  # texts of constrained outputs the grammar ended

        def run(ps: list[dict[str, Any]]) -> tuple[float, list[int], dict[str, Any]]:
            lens, before, start = [], dict(engine.get_server_info()), time.perf_counter()
            for i in range(0, len(prompts), ns.batch_size):
                outs = engine.generate(
                    input_ids=prompts[i : i + ns.batch_size],
                    sampling_params=ps[i : i + ns.batch_size],
                )
                lens += [o["meta_info"]["completion_tokens"] for o in outs]
                if "json_schema" in ps[0]:
                    done.extend(t for t in map(_finished_text, outs) if t is not None)
            elapsed = time.perf_counter() - start
            return elapsed, lens, step_profile(before, engine.get_server_info())

        t_con, lens, steps_con = run(params)
        engine.flush_cache()
        time.sleep(0.2)
        free = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in lens]
        t_free, lens_free, steps_free = run(free)
    tokens = sum(lens)
    result = {
        "bench": "structured",
        "grammar_backend": args.grammar_backend,
        "device": info["device"],
        "dtype": info["dtype"],
        "batch_size": ns.batch_size,
        "engine_backend": ns.engine_backend,
        "num_prompts": ns.num_prompts,
        "compile_ms_p50": statistics.median(compile_ms),
        "compile_ms_p99": _pct(compile_ms, 0.99),
        "compile_ms_max": max(compile_ms),
        "output_tokens": tokens,
        "constrained_tok_s": tokens / t_con,
        "unconstrained_tok_s": sum(lens_free) / t_free,
        "attention_backend": info["attention_backend"],
    }
    result["overhead"] = result["unconstrained_tok_s"] / result["constrained_tok_s"] - 1
    # A check that the constrained path still constrains: outputs the grammar ended parse.
    result["grammar_ended"] = len(done)
    result["grammar_ended_parse"] = sum(_parses(t) for t in done)
    # Decode steps alone (the scheduler's step profile): no prefill, no request set-up.
    for tag, st in (("constrained", steps_con), ("unconstrained", steps_free)):
        result[f"{tag}_decode_tok_s"] = st["num_decode_tokens"] / max(st["time_decode_s"], 1e-9)
        result[f"{tag}_steps"] = st
    result["decode_overhead"] = (
        result["unconstrained_decode_tok_s"] / result["constrained_decode_tok_s"] - 1
    )
    print(
        f"Loom structured ({args.grammar_backend}, {info['device']}, batch {ns.batch_size}): "
        f"compile p50 {result['compile_ms_p50']:.2f} ms, p99 {result['compile_ms_p99']:.2f} ms; "
        f"end to end constrained {result['constrained_tok_s']:.1f} tok/s vs unconstrained "
        f"{result['unconstrained_tok_s']:.1f} tok/s ({100 * result['overhead']:+.1f}% overhead); "
        f"decode steps alone {result['constrained_decode_tok_s']:.1f} vs "
        f"{result['unconstrained_decode_tok_s']:.1f} tok/s "
        f"({100 * result['decode_overhead']:+.1f}%), {tokens} tokens; "
        f"{result['grammar_ended_parse']}/{result['grammar_ended']} grammar-ended outputs parse"
    )
    for tag, st in (("constrained", steps_con), ("unconstrained", steps_free)):
        print(f"  {tag}: {host_phases(st)}")
    append_result(ns.result_file, result)
    return 0
