"""The ``llguidance`` grammar backend: Microsoft's llguidance (Earley parser over a lexer).

JSON schemas compile without free whitespace and in strict mode, as with ``xgrammar``: an object
schema that does not say ``additionalProperties`` gets ``false`` (llguidance alone would allow
any extra key, and a small model can wander into an endless key string). EBNF
(GBNF syntax, ``root`` rule) is converted to Lark with llguidance's own converter. Keywords
llguidance does not enforce are a 400 naming the keyword and its place (``schema_support.py``);
``structural_tag`` is not supported (use ``xgrammar``).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from loom.constrained.base import GrammarBackend, GrammarError, GrammarMatcher
from loom.constrained.schema_support import check_schema

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` has it
    set to false (xgrammar's strict mode)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    return out


def tokenizer_json(tokenizer: Any) -> str:
    """The fast tokenizer's serialisation as llguidance reads it, with a decoder that is a
    ``Sequence`` holding a ``ByteLevel`` step replaced by that step alone. transformers (5.17)
    converts some GGUF tokenizers (SmolLM2's) to ``Sequence[ByteFallback, Fuse, Replace,
    ByteLevel]``; llguidance (1.9) then reads the vocabulary as byte-fallback text, taking
    ``Ċ`` (a newline) for a letter, and lets raw control characters into JSON strings. The
    other steps do nothing to a byte-level vocabulary."""
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    decoder = data.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        levels = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if levels:
            data["decoder"] = levels[0]
    return json.dumps(data)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def accept_token(self, token_id: int) -> bool:
        # try_consume_tokens leaves the state unchanged when the token is refused
        return self.m.try_consume_tokens([token_id]) == 1

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, mask, row)

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())

    def copy(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.m.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size, stop_token_ids=None, **options) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, **options)
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        stops = list(self.stop_token_ids or [])
        text = tokenizer_json(tokenizer)
        try:
            self.lltok = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=stops or None)
        except TypeError:  # llguidance < 1.7 takes a single end-of-sequence id
            eos = stops[0] if stops else tokenizer.eos_token_id
            self.lltok = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        self._executor = None

    def compile(self, kind: str, text: str) -> Any:
        ll = self._ll
        try:
            if kind == "json_schema":
                schema = check_schema(text, "llguidance")[0]
                grammar = ll.LLMatcher.grammar_from_json_schema(
                    json.dumps(strict_schema(schema)),
                    defaults={"whitespace_flexible": False},
                )
            elif kind == "regex":
                grammar = ll.LLMatcher.grammar_from_regex(text)
            elif kind == "ebnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                grammar = ll.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
            elif kind == "structural_tag":
                raise GrammarError("structural_tag needs --grammar-backend xgrammar")
            else:
                raise GrammarError(f"unknown constraint kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GrammarError(f"{kind} is invalid: {e}") from e
        error = ll.LLMatcher.validate_grammar(grammar, self.lltok)
        if error:
            raise GrammarError(f"{kind} is invalid: {error}")
        return grammar

    def matcher(self, compiled: Any) -> GrammarMatcher:
        m = self._ll.LLMatcher(self.lltok, compiled, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return LLGuidanceMatcher(m)

    def fill_vocab_masks(self, matchers, mask, rows) -> None:
        if len(matchers) > 1 and all(isinstance(m, LLGuidanceMatcher) for m in matchers):
            from llguidance.torch import fill_next_token_bitmask_par

            if self._executor is None:
                self._executor = self._ll.LLExecutor()  # Rust threads
            fill_next_token_bitmask_par(
                self._executor, [(m.m, r) for m, r in zip(matchers, rows, strict=True)], mask
            )
        else:
            super().fill_vocab_masks(matchers, mask, rows)

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask

        return allocate_token_bitmask(batch_size, self.vocab_size)

    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        from llguidance.torch import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, mask)
