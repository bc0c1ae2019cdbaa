"""The grammar's host work per decode step: mask fills on 1 and 2 threads, mid-generation.

python bench/grammar_host_micro.py TOKENIZER_DIR [xgrammar|llguidance] [steps]

Each of the 25 benchmark schemas gets a matcher; every step fills the live rows' masks with
each thread count (the first fill of a new state pays the mask computation; later fills of the
same state may be cached, so the order of the variants rotates every step), applies them to
random logits, and advances every matcher by the masked argmax. Prints mean microseconds per
step for each variant and the mean number of live rows.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoTokenizer

from loom.bench.json_schemas import SCHEMAS
from loom.config import ServerArgs
from loom.constrained.manager import build_grammar_backend


def _fillers(name, backend):
    if name == "xgrammar":
        import xgrammar as xgr

        batch = {k: xgr.BatchGrammarMatcher(k) for k in (1, 2)}
        return {
            f"{k} thread(s)": (
                lambda ms, mask, rows, b=b: b.batch_fill_next_token_bitmask(
                    [m.m for m in ms], mask, rows
                )
            )
            for k, b in batch.items()
        }
    import llguidance
    from llguidance.torch import fill_next_token_bitmask_par

    ex = {k: llguidance.LLExecutor(k) for k in (1, 2)}
    return {
        f"{k} thread(s)": (
            lambda ms, mask, rows, e=e: fill_next_token_bitmask_par(
                e, [(m.m, r) for m, r in zip(ms, rows, strict=True)], mask
            )
        )
        for k, e in ex.items()
    }


def main() -> None:
    tok_dir = sys.argv[1]
    name = sys.argv[2] if len(sys.argv) > 2 else "xgrammar"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(tok)
    backend = build_grammar_backend(
        ServerArgs(grammar_backend=name), tok, vocab, {tok.eos_token_id}
    )
    ms = [backend.matcher(backend.compile("json_schema", json.dumps(s))) for _, s in SCHEMAS]
    mask = backend.allocate_vocab_mask(len(ms))
    fillers = _fillers(name, backend)
    labels = list(fillers)
    total = dict.fromkeys(labels, 0.0)
    gen = torch.Generator().manual_seed(0)
    done = rows_total = 0
    for step in range(steps):
        live = [i for i, m in enumerate(ms) if not m.is_terminated()]
        if not live:
            break
        order = labels[step % len(labels) :] + labels[: step % len(labels)]
        for label in order:
            t = time.perf_counter()
            fillers[label]([ms[i] for i in live], mask, live)
            total[label] += time.perf_counter() - t
        logits = torch.randn(len(ms), vocab, generator=gen)
        backend.apply_vocab_mask(logits, mask)
        tokens = logits.argmax(-1).tolist()
        for i in live:
            ms[i].accept_token(tokens[i])
        done += 1
        rows_total += len(live)
    per = ", ".join(f"{k} {1e6 * v / done:.1f} us" for k, v in total.items())
    print(
        f"{name}: {done} steps, mean live rows {rows_total / done:.1f}; mask fill per step: {per}"
    )


if __name__ == "__main__":
    main()
