"""Host cost of a constrained decode step's grammar work, without a model: 16 matchers over 16 of
the 25 benchmark JSON schemas walk random allowed tokens; per step, the batch mask fill and the
tokens' accept (one call per row, or one batch call), alone and beside a thread running Python
(as an engine's other threads may be: each call that releases the interpreter lock must then win
it back).

python bench/grammar_host.py TOKENIZER_DIR [VOCAB_SIZE]
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time


def main() -> None:
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from loom.bench.json_schemas import SCHEMAS

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    comp = xgr.GrammarCompiler(info)
    grammars = [
        comp.compile_json_schema(json.dumps(s), any_whitespace=False, strict_mode=True)
        for _, s in SCHEMAS[:16]
    ]
    stop_ids = set(info.stop_token_ids)
    filler = xgr.BatchGrammarMatcher(1)
    mask = xgr.allocate_token_bitmask(len(grammars), vocab)
    bits = torch.arange(32, dtype=torch.int32)

    def run(busy: bool, batched: bool) -> tuple[float, float]:
        rng = random.Random(0)
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        if busy:
            threading.Thread(target=spin, daemon=True).start()
        ms = [xgr.GrammarMatcher(g) for g in grammars]
        t_fill = t_acc = 0.0
        steps = 0
        try:
            for _ in range(48):
                live = [i for i, m in enumerate(ms) if not m.is_terminated()]
                if len(live) < len(ms) * 3 // 4:
                    break
                t = time.perf_counter()
                filler.batch_fill_next_token_bitmask([ms[i] for i in live], mask, live)
                t_fill += time.perf_counter() - t
                toks = []
                for i in live:
                    allowed = ((mask[i].unsqueeze(1) >> bits) & 1).flatten()[:vocab].nonzero()
                    ids = [int(a) for a in allowed.flatten()]
                    toks.append(rng.choice([a for a in ids if a not in stop_ids] or ids))
                t = time.perf_counter()
                if batched:
                    oks = xgr.BatchGrammarMatcher.batch_accept_token([ms[i] for i in live], toks)
                    for i, ok, tk in zip(live, oks, toks, strict=True):
                        _ = ok and tk in stop_ids and ms[i].is_terminated()
                else:
                    for i, tk in zip(live, toks, strict=True):
                        _ = ms[i].accept_token(tk) and ms[i].is_terminated()
                t_acc += time.perf_counter() - t
                steps += 1
        finally:
            stop.set()
        return 1e6 * t_fill / steps, 1e6 * t_acc / steps

    for busy in (False, True):
        for batched in (False, True):
            fill, acc = run(busy, batched)
            print(
                f"{'beside a busy thread' if busy else 'alone':20s} "
                f"{'batch accept' if batched else 'accept per row':15s}: "
                f"fill {fill:7.0f} us/step, accept {acc:7.0f} us/step ({len(grammars)} rows)",
                flush=True,
            )


if __name__ == "__main__":
    main()
