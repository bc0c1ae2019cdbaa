"""The ``xgrammar`` grammar backend (default): XGrammar's compiler, matchers and bitmask kernels.

JSON schemas compile without free whitespace (``any_whitespace=False``: compact JSON), which
keeps small models from looping on blank lines, and in strict mode (no properties beyond the
schema's unless it says ``additionalProperties``). A schema with keywords XGrammar would drop
and llguidance enforces (a length beside a pattern, ``allOf``, ...; ``schema_support.py``) is
compiled by llguidance instead: its matchers fill the same bitmask layout, so they share the
batch's mask and XGrammar's kernel. Keywords neither enforces are a 400. EBNF is XGrammar's
GBNF dialect with a ``root`` rule.

In a JSON schema's answer XGrammar's masks also admit, inside strings, special tokens (SmolLM2's
``<|endoftext|>``, ``<|im_start|>``: dropped when the answer is decoded, which can leave a
string shorter than its ``minLength``) and, in some states, tokens holding raw control
characters (which ``json.loads`` rejects); a model-free fuzz of the bench's schemas found both
(``bench/grammar_fuzz.py``). Compact JSON has no place for either, so a JSON schema's rows are
also cleared of them (``json_safe_words``: one AND per row).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from loom.constrained.base import GrammarBackend, GrammarError, GrammarMatcher
from loom.constrained.schema_support import check_schema, check_tag_schemas

_HALF_CPUS = max(1, (os.cpu_count() or 2) // 2)


def json_safe_words(
    tokenizer: Any, texts: list[str], vocab_size: int, stop_token_ids
) -> torch.Tensor:
    """A bitmask row (int32 words) of the tokens a compact JSON answer may hold: all but the
    special tokens other than the stop tokens, and tokens whose text (``texts``: each id's,
    decoded alone) has a character below U+0020."""
    stops = set(stop_token_ids or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special = {i for i, t in added.items() if getattr(t, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", None) or [])
    banned = special - stops
    for i, text in enumerate(texts):
        if i not in stops and any(ord(ch) < 32 for ch in text):
            banned.add(i)
    words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
    for i in banned:
        if 0 <= i < vocab_size:
            words[i >> 5] &= np.uint32(~(1 << (i & 31)) & 0xFFFFFFFF)
    return torch.from_numpy(words.view(np.int32))


class XGrammarMatcher(GrammarMatcher):
    """``safe``: for a JSON schema, the ``json_safe_words`` row its masks are ANDed with."""

    def __init__(self, matcher: Any, safe: torch.Tensor | None = None) -> None:
        self.m = matcher
        self.safe = safe

    def accept_token(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(mask, row)
        if self.safe is not None:
            mask[row] &= self.safe

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.m.fork(), self.safe)


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
        self._llguidance: GrammarBackend | None = None
        self._json_safe: torch.Tensor | None = None

    def compile(self, kind: str, text: str) -> Any:
        c = self.compiler
        if kind == "json_schema":
            schema, gaps = check_schema(text, "xgrammar")
            if gaps:
                return _ByLLGuidance(self.llguidance().compile(kind, text))
            text = json.dumps(schema)
        if kind == "structural_tag":
            check_tag_schemas(text)
        try:
            if kind == "json_schema":
                compiled = c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
                return _Json(compiled, self.json_safe())
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
            if kind == "structural_tag":
                return c.compile_structural_tag(text)
        except Exception as e:  # noqa: BLE001 - the library raises several types; all are 400s
            raise GrammarError(f"{kind} is invalid: {e}") from e
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def llguidance(self) -> GrammarBackend:
        """The llguidance backend over the same tokenizer, for schemas XGrammar would weaken."""
        if self._llguidance is None:
            from loom.constrained.llguidance_backend import LLGuidanceBackend

            self._llguidance = LLGuidanceBackend(
                self.tokenizer, self.vocab_size, self.stop_token_ids
            )
        return self._llguidance

    def json_safe(self) -> torch.Tensor:
        """``json_safe_words`` for this vocabulary (computed once, on a compile thread)."""
        if self._json_safe is None:
            self._json_safe = json_safe_words(
                self.tokenizer, self.token_texts(), self.vocab_size, self.stop_token_ids
            )
        return self._json_safe

    def matcher(self, compiled: Any) -> GrammarMatcher:
        if isinstance(compiled, _ByLLGuidance):
            return self.llguidance().matcher(compiled.grammar)
        if isinstance(compiled, _Json):
            return XGrammarMatcher(self._xgr.GrammarMatcher(compiled.grammar), compiled.safe)
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_vocab_masks(self, matchers, mask, rows) -> None:
        """One call into XGrammar's batch filler (no Python per row). It runs on one thread below
        64 rows: its worker threads cost a fixed ~70 us a call here even at root states, and
        1.8 ms against 68 us single-threaded for ~16 rows mid-generation (2 threads on this
        2-core machine; docs/benchmarks.md), while a row's mask takes ~4 us. Larger batches
        get one thread per 32 rows, up to half the CPUs."""
        mine = [(m.m, r) for m, r in zip(matchers, rows, strict=True) if type(m) is XGrammarMatcher]
        if len(mine) > 1:
            threads = 1 if len(mine) < 64 else max(1, min(_HALF_CPUS, len(mine) // 32))
            batch = self._batch.get(threads)
            if batch is None:
                batch = self._batch[threads] = self._xgr.BatchGrammarMatcher(threads)
            batch.batch_fill_next_token_bitmask([m for m, _ in mine], mask, [r for _, r in mine])
            safe = [
                r
                for m, r in zip(matchers, rows, strict=True)
                if type(m) is XGrammarMatcher and m.safe is not None
            ]
            if safe:
                mask[safe] &= self.json_safe()
        for m, row in zip(matchers, rows, strict=True):
            if len(mine) <= 1 or type(m) is not XGrammarMatcher:
                m.fill_vocab_mask(mask, row)

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size)


class _Json:
    """A JSON schema compiled by XGrammar, and the ``json_safe_words`` its masks keep to."""

    def __init__(self, grammar: Any, safe: torch.Tensor) -> None:
        self.grammar = grammar
        self.safe = safe


class _ByLLGuidance:
    """A schema compiled by llguidance (see the module's docstring)."""

    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar
