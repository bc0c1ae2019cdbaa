"""Model-free fuzzing of the JSON-schema grammars: which answers a grammar backend lets end that
``jsonschema`` rejects, for the 25 schemas of ``loom.bench.json_schemas`` (as users write them:
``structured_validity.as_written``).

    python bench/grammar_fuzz.py [--grammar-backend llguidance xgrammar] [--walks 30]
        [--max-tokens 200] [--seed 0] [--stop-prob 0.3] [--special-prob 0.02]
        [--struct-bias 0.5] [--tokenizer DIR_OR_GGUF] [--schemas 0 6 ...] [--json OUT.jsonl]

The backend is built as the engine builds it (``build_grammar_backend``, the model's tokenizer
and stop ids) and each schema compiled from the same text the bench sends. ``--tokenizer``: an
HF tokenizer directory (default: the default model's reference tokenizer), or a GGUF file,
whose tokenizer is converted by the installed transformers as Loom's GGUF loader does. The
version matters: transformers 5.17 wraps the GGUF tokenizer's ByteLevel decoder in a Sequence
with ByteFallback, which llguidance 1.9.1 reads as a byte-fallback vocabulary, taking ``Ċ``
(a newline) for a letter, so it lets raw control characters into strings. A walk fills the mask, picks an allowed token and feeds it back,
for at most ``--max-tokens`` tokens: a stop token, when allowed, with probability
``--stop-prob``; else a special token (``<file_sep>``...), when allowed, with probability
``--special-prob``; else, with probability ``--struct-bias``, a token whose text holds a JSON
structural character (so that strings and numbers close); else any allowed token, uniformly.
A walk ends when the matcher terminates (the engine's finish reason ``stop``); its text
(decoded as the engine decodes, special tokens skipped) must parse with ``json.loads`` and
validate with ``Draft202012Validator`` (formats checked). Printed per backend: walks,
terminated, invalid, terminated walks holding a special token (absent from the text), and the
distinct failure reasons (validator keyword, its value and the instance path, arrays' indices
as ``*``) with a count and an example; and which formats the schemas use and whether
``jsonschema`` checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections import defaultdict
from importlib.metadata import version
from types import SimpleNamespace

import jsonschema
import numpy as np
import transformers

from loom.bench.json_schemas import SCHEMAS
from loom.constrained.manager import build_grammar_backend
from loom.constrained.schema_support import subschemas

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_validity import as_written  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, ".cache/hf-ref/smollm2-135m-instruct-v2")  # the default model's
VOCAB_SIZE = 49152
STRUCTURAL = set('"{}[],:')
Validator = jsonschema.Draft202012Validator


def load_tokenizer(path: str):
    """An HF tokenizer directory, or a GGUF file's tokenizer as Loom's GGUF loader builds it."""
    if path.endswith(".gguf"):
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
    return transformers.AutoTokenizer.from_pretrained(path)


def stop_ids(tok) -> list[int]:
    ids = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def allowed_ids(mask_row) -> np.ndarray:
    """The token ids a bitmask row (int32 words, 32 tokens each, low bit first) allows."""
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB_SIZE])


def walk(backend, compiled, rng, ns, stops, kinds, mask):
    """One random walk: (token ids, terminated, by_stop_token, rejected token or None).
    ``kinds``: per token id, 1 for a structural token, 2 for a special one, else 0."""
    m = backend.matcher(compiled)
    ids: list[int] = []
    for _ in range(ns.max_tokens):
        backend.reset_vocab_mask(mask)
        m.fill_vocab_mask(mask, 0)
        allowed = allowed_ids(mask[0])
        is_stop = np.isin(allowed, stops)
        stop_ok, others = allowed[is_stop].tolist(), allowed[~is_stop]
        if stop_ok and (rng.random() < ns.stop_prob or len(others) == 0):
            tok = rng.choice(stop_ok)
        elif len(others) == 0:
            return ids, False, False, None  # nothing allowed and no stop: a dead end
        else:
            pool, special = others, others[kinds[others] == 2]
            if len(special) and rng.random() < ns.special_prob:
                pool = special
            elif rng.random() < ns.struct_bias and (kinds[others] == 1).any():
                pool = others[kinds[others] == 1]
            tok = int(pool[rng.randrange(len(pool))])
        if not m.accept_token(tok):
            return ids, False, False, tok  # the mask allowed a token the matcher refuses
        ids.append(tok)
        if m.is_terminated():
            return ids, True, tok in stops, None
    return ids, False, False, None


def failure(validator, text):
    """None for a valid answer, else (group key, message, instance path)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"json.loads: {e.msg}", str(e), "$"
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    e = errors[0]
    path = re.sub(r"\[\d+\]", "[*]", e.json_path)
    return f"{e.validator}={json.dumps(e.validator_value)[:80]} at {path}", e.message, e.json_path


def format_report(schemas) -> list[str]:
    """The formats the schemas use, and whether jsonschema's format checker checks each."""
    checked = set(Validator.FORMAT_CHECKER.checkers)
    used = defaultdict(list)
    for i, (_, s) in enumerate(schemas):
        for sub, ptr in subschemas(s):
            if isinstance(sub.get("format"), str):
                used[sub["format"]].append(f"{i}:{ptr}")
    lines = [f"jsonschema {version('jsonschema')} checks formats: {', '.join(sorted(checked))}"]
    for fmt, where in sorted(used.items()):
        state = "checked" if fmt in checked else "NOT checked (passes silently)"
        lines.append(f"  format {fmt!r} used at {', '.join(where)}: {state}")
    return lines


def run_backend(name, schemas, tok, stops, ns):
    args = SimpleNamespace(
        grammar_backend=name,
        reasoner_grammar_backend=name,
        reasoning_parser=None,
        think_end_token=None,
        think_budget=None,
    )
    backend = build_grammar_backend(args, tok, VOCAB_SIZE, stops)
    kinds = np.zeros(VOCAB_SIZE, dtype=np.int8)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(
        tok.all_special_ids
    )
    for i in range(len(tok)):
        kinds[i] = 2 if i in special else int(bool(STRUCTURAL & set(tok.decode([i]))))
    mask = backend.allocate_vocab_mask(1)
    rng = random.Random(ns.seed)
    totals = dict(walks=0, terminated=0, by_stop_token=0, invalid=0, with_special=0, refused=0)
    groups: dict[str, list[dict]] = defaultdict(list)
    start = time.perf_counter()
    for i, schema in schemas:
        compiled = backend.compile("json_schema", json.dumps(schema))
        validator = Validator(schema, format_checker=Validator.FORMAT_CHECKER)
        for _ in range(ns.walks):
            ids, ended, by_stop, refused = walk(backend, compiled, rng, ns, stops, kinds, mask)
            totals["walks"] += 1
            if refused is not None:
                totals["refused"] += 1
                groups["accept_token refused a token the mask allowed"].append(
                    dict(schema=i, message=f"token {refused}", path="", text=tok.decode(ids))
                )
            if not ended:
                continue
            totals["terminated"] += 1
            totals["by_stop_token"] += by_stop
            totals["with_special"] += any(kinds[t] == 2 and t not in stops for t in ids)
            text = tok.decode([t for t in ids if t not in stops], skip_special_tokens=True)
            bad = failure(validator, text)
            if bad is not None:
                totals["invalid"] += 1
                key, message, path = bad
                groups[key].append(dict(schema=i, message=message, path=path, text=text))
    totals["elapsed_s"] = round(time.perf_counter() - start, 1)
    return totals, groups


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grammar-backend", nargs="+", default=["llguidance"])
    p.add_argument("--walks", type=int, default=30, help="walks per schema")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-prob", type=float, default=0.3)
    p.add_argument("--special-prob", type=float, default=0.02)
    p.add_argument("--struct-bias", type=float, default=0.5)
    p.add_argument("--tokenizer", default=TOKENIZER, help="HF tokenizer directory or .gguf file")
    p.add_argument("--schemas", type=int, nargs="+", default=None, help="indices (default all)")
    p.add_argument("--json", default=None, help="append every failure here (JSON lines)")
    ns = p.parse_args()
    schemas = [(task, as_written(s)) for task, s in SCHEMAS]
    chosen = [(i, schemas[i][1]) for i in (ns.schemas or range(len(schemas)))]
    tok = load_tokenizer(ns.tokenizer)
    stops = stop_ids(tok)
    print("\n".join(format_report(schemas)))
    for name in ns.grammar_backend:
        totals, groups = run_backend(name, chosen, tok, stops, ns)
        print(
            f"\n== {name} (stop ids {stops}, seed {ns.seed}, tokenizer {ns.tokenizer}, "
            f"transformers {transformers.__version__}): {json.dumps(totals)}"
        )
        for key, fails in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            ex = fails[0]
            where = sorted({f["schema"] for f in fails})
            print(f"- {len(fails)}x {key} (schemas {where})")
            print(f"    e.g. schema {ex['schema']} at {ex['path']}: {ex['message'][:200]}")
            print(f"    text: {ex['text'][:300]!r}")
        if ns.json:
            with open(ns.json, "a") as f:
                for key, fails in groups.items():
                    for x in fails:
                        f.write(json.dumps(dict(backend=name, reason=key, **x)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
