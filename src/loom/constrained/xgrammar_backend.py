"""The ``xgrammar`` grammar backend (default): XGrammar's compiler, matchers and bitmask kernels.

JSON schemas compile without free whitespace (``any_whitespace=False``: compact JSON), which
keeps small models from looping on blank lines, and in strict mode (no properties beyond the
schema's unless it says ``additionalProperties``). EBNF is XGrammar's GBNF dialect with a
``root`` rule.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from loom.constrained.base import GrammarBackend, GrammarError, GrammarMatcher

_HALF_CPUS = max(1, (os.cpu_count() or 2) // 2)


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.m.fork())


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size, stop_token_ids=None, **options) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, **options)
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=int(options.get("max_threads", 4)))
        self._batch: dict[int, Any] = {}  # thread count -> xgr.BatchGrammarMatcher

    def compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        try:
            if kind == "json_schema":
                return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
            if kind == "structural_tag":
                return c.compile_structural_tag(text)
        except Exception as e:  # noqa: BLE001 - the library raises several types; all are 400s
            raise GrammarError(f"{kind} is invalid: {e}") from e
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_vocab_masks(self, matchers, mask, rows) -> None:
        """One call into XGrammar's batch filler (no Python per row). It runs on one thread below
        64 rows: its worker threads cost a fixed ~70 us a call here even at root states, and
        1.8 ms against 68 us single-threaded for ~16 rows mid-generation (2 threads on this
        2-core machine; docs/benchmarks.md), while a row's mask takes ~4 us. Larger batches
        get one thread per 32 rows, up to half the CPUs."""
        if len(matchers) > 1 and all(isinstance(m, XGrammarMatcher) for m in matchers):
            threads = 1 if len(matchers) < 64 else max(1, min(_HALF_CPUS, len(matchers) // 32))
            batch = self._batch.get(threads)
            if batch is None:
                batch = self._batch[threads] = self._xgr.BatchGrammarMatcher(threads)
            batch.batch_fill_next_token_bitmask([m.m for m in matchers], mask, rows)
        else:
            super().fill_vocab_masks(matchers, mask, rows)

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size)
