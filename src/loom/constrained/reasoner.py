"""The ``reasoner`` grammar backend: free text until the think-end token, then the grammar.

Wraps another backend (``--reasoner-grammar-backend``, default xgrammar). The think-end string
comes from ``--think-end-token`` or a ``--reasoning-parser`` preset; it may tokenize to several
ids, which must appear consecutively. With ``--think-budget N`` the think-end sequence is forced
(the mask allows only its next id) once N tokens have been thought without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from loom import plugins
from loom.constrained.base import GrammarBackend, GrammarMatcher

REASONING_PARSERS = {
    "deepseek-r1": "</think>",
    "qwen3": "</think>",
    "glm45": "</think>",
    "kimi": "◁/think▷",
}


def set_only_token(mask: torch.Tensor, row: int, token: int) -> None:
    """Row ``row`` of an int32 bitmask allows ``token`` alone."""
    mask[row].zero_()
    bit = 1 << (token % 32)
    mask[row, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit


@dataclass
class _State:
    thinking: bool = True
    thought: int = 0  # tokens accepted while thinking
    forced: int = -1  # >= 0: how many think-end ids have been forced so far
    recent: list[int] = field(default_factory=list)


class ReasonerMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, end_ids: list[int], budget: int | None) -> None:
        self.inner = inner
        self.end_ids = end_ids
        self.budget = budget
        self.state = _State(forced=0 if budget == 0 else -1)
        self.history: list[tuple[_State, bool]] = []  # (state before, went to inner)

    def _snapshot(self) -> _State:
        s = self.state
        return _State(s.thinking, s.thought, s.forced, list(s.recent))

    def accept_token(self, token_id: int) -> bool:
        s = self.state
        if not s.thinking:
            if not self.inner.accept_token(token_id):
                return False
            self.history.append((None, True))
            return True
        if s.forced >= 0 and token_id != self.end_ids[s.forced]:
            return False
        self.history.append((self._snapshot(), False))
        s.thought += 1
        if s.forced >= 0:
            s.forced += 1
        s.recent = (s.recent + [token_id])[-len(self.end_ids) :]
        if s.recent == self.end_ids or s.forced == len(self.end_ids):
            s.thinking, s.forced = False, -1
        elif s.forced < 0 and self.budget is not None and s.thought >= self.budget:
            s.forced = 0
        return True

    def rollback(self, num_tokens: int) -> None:
        inner = 0
        for _ in range(num_tokens):
            before, to_inner = self.history.pop()
            if to_inner:
                inner += 1
            else:
                self.state = before
        if inner:
            self.inner.rollback(inner)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        s = self.state
        if not s.thinking:
            self.inner.fill_vocab_mask(mask, row)
        elif s.forced >= 0:
            set_only_token(mask, row, self.end_ids[s.forced])
        # thinking freely: the row stays all-allowed

    def is_terminated(self) -> bool:
        return not self.state.thinking and self.inner.is_terminated()

    def copy(self) -> ReasonerMatcher:
        other = ReasonerMatcher(self.inner.copy(), self.end_ids, self.budget)
        other.state = self._snapshot()
        other.history = [
            (None if b is None else _State(b.thinking, b.thought, b.forced, list(b.recent)), t)
            for b, t in self.history
        ]
        return other


class ReasonerBackend(GrammarBackend):
    def __init__(
        self,
        tokenizer,
        vocab_size,
        stop_token_ids=None,
        inner: str = "xgrammar",
        think_end_token: str | None = None,
        reasoning_parser: str | None = None,
        think_budget: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(tokenizer, vocab_size, stop_token_ids, **options)
        if inner == "reasoner":
            raise ValueError("the reasoner backend cannot wrap itself")
        end = think_end_token or REASONING_PARSERS.get(reasoning_parser or "")
        if not end:
            raise ValueError(
                "--grammar-backend reasoner needs --think-end-token or --reasoning-parser "
                f"({', '.join(REASONING_PARSERS)})"
            )
        self.end_ids = tokenizer.encode(end, add_special_tokens=False)
        if not self.end_ids:
            raise ValueError(f"think-end token {end!r} encodes to no tokens")
        self.budget = think_budget
        self.inner = plugins.resolve("grammar_backend", inner)(
            tokenizer, vocab_size, stop_token_ids, **options
        )

    def compile(self, kind: str, text: str) -> Any:
        return self.inner.compile(kind, text)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return ReasonerMatcher(self.inner.matcher(compiled), self.end_ids, self.budget)

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return self.inner.allocate_vocab_mask(batch_size)

    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.inner.apply_vocab_mask(logits, mask)
