"""How many structured answers validate: the 25 schemas of ``loom.bench.json_schemas`` with their
strings unbounded as users write them (the ``maxLength`` the bench set adds to plain strings
removed; bounds beside a pattern or a format kept), each answered greedily and sampled twice
(temperature 1, seeds 0 and 1) by the default model, at each ``--max-new-tokens``.

    python bench/structured_validity.py [--grammar-backend xgrammar] [--max-new-tokens 768 128]
        [--close on off] [--json OUT.jsonl] [--model GGUF_OR_DIR] [--dtype DTYPE]

An answer is valid when the grammar ended it (finish reason ``stop``) and ``jsonschema`` accepts
it (formats checked). Also reported: how many answers were steered to close within the budget,
and the grammar's host time per output token (mask fills, the closing walk included). Runs
against any Loom tree on ``PYTHONPATH`` (``--close`` needs ``close_within_budget``; a tree
without it runs ``off`` only).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import jsonschema

import loom
from loom.bench.json_schemas import SCHEMAS


def as_written(schema):
    """``schema`` with ``maxLength`` dropped from strings that have no pattern or format."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "string" and not ({"pattern", "format"} & node.keys()):
                node.pop("maxLength", None)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    return schema


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grammar-backend", default="xgrammar")
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[768, 128])
    p.add_argument("--close", nargs="+", default=["on", "off"], choices=("on", "off"))
    p.add_argument("--json", default=None)
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--dtype", default="auto")
    ns = p.parse_args()
    schemas = [(task, as_written(s)) for task, s in SCHEMAS]
    kw = {"model": ns.model} if ns.model else {}
    with loom.Engine(
        grammar_backend=ns.grammar_backend, max_total_tokens=65536, dtype=ns.dtype, **kw
    ) as e:
        prompts, checks, texts = [], [], []
        for task, schema in schemas:
            msg = [{"role": "user", "content": f"{task} Answer with a JSON object only."}]
            prompts.append(e.apply_chat_template(msg))
            checks.append(
                jsonschema.Draft202012Validator(
                    schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
                )
            )
            texts.append(json.dumps(schema))
        for budget in ns.max_new_tokens:
            for close in ns.close:
                ids, params = [], []
                for prompt, text in zip(prompts, texts, strict=True):
                    for seed in (None, 0, 1):
                        sp = {"max_new_tokens": budget, "json_schema": text}
                        sp.update(
                            {"temperature": 0}
                            if seed is None
                            else {"temperature": 1.0, "sampling_seed": seed}
                        )
                        if close == "on":
                            sp["close_within_budget"] = True
                        elif "close_within_budget" in loom.SamplingParams.__dataclass_fields__:
                            sp["close_within_budget"] = False
                        ids.append(prompt)
                        params.append(sp)
                before = e.get_server_info().get("time_grammar_mask_s", 0.0)
                start = time.perf_counter()
                outs = e.generate(input_ids=ids, sampling_params=params)
                elapsed = time.perf_counter() - start
                mask_s = e.get_server_info().get("time_grammar_mask_s", 0.0) - before
                valid = closed = stopped = 0
                rejected = []  # answers the grammar ended that do not validate, and why
                for k, o in enumerate(outs):
                    reason = o["meta_info"]["finish_reason"] or {}
                    closed += "closed_within_budget_at" in reason
                    if reason.get("type") != "stop":
                        continue
                    stopped += 1
                    try:
                        err = next(checks[k // 3].iter_errors(json.loads(o["text"])), None)
                    except ValueError as exc:
                        err = exc
                    valid += err is None
                    if err is not None:
                        why = getattr(err, "message", None) or str(err)
                        rejected.append({"answer": k, "why": why[:160], "text": o["text"][:400]})
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                row = {
                    "device": e.get_server_info().get("device"),
                    "grammar_backend": ns.grammar_backend,
                    "max_new_tokens": budget,
                    "close_within_budget": close,
                    "answers": len(outs),
                    "valid": valid,
                    "ended_by_grammar": stopped,
                    "closed_within_budget": closed,
                    "output_tokens": tokens,
                    "elapsed_s": elapsed,
                    "grammar_host_us_per_token": 1e6 * mask_s / max(tokens, 1),
                    "rejected": rejected,
                }
                print(json.dumps(row), flush=True)
                if ns.json:
                    with open(ns.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
