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
from loom.reasoning import REASONING_FORMATS, ReasoningFormat, starts_in_reasoning


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
    # >= 0: the output has not shown yet whether it thinks (the prompt opened no thoughts);
    # this many ids of the think-start sequence have been accepted
    opening: int = -1

    def copy(self) -> _State:
        return _State(self.thinking, self.thought, self.forced, list(self.recent), self.opening)


class ReasonerMatcher(GrammarMatcher):
    """Free while thinking, the inner matcher after. ``start_ids`` None: started inside the
    thoughts (the prompt opened them); given: "opening", the output thinks only if it begins
    with the think-start ids, any other first token being the inner grammar's; empty: the
    answer from the first token."""

    def __init__(
        self,
        inner: GrammarMatcher,
        end_ids: list[int],
        budget: int | None,
        start_ids: list[int] | None = None,
    ) -> None:
        self.inner = inner
        self.end_ids = end_ids
        self.budget = budget
        self.start_ids = start_ids or []
        if self.start_ids:
            self.state = _State(thinking=False, opening=0)
        elif start_ids is not None:  # [] : the answer from the first token
            self.state = _State(thinking=False)
        else:
            self.state = _State(forced=0 if budget == 0 else -1)
        self.history: list[tuple[_State, bool]] = []  # (state before, went to inner)

    def accept_token(self, token_id: int) -> bool:
        s = self.state
        before = s.copy()
        if s.opening >= 0:
            if token_id == self.start_ids[s.opening]:
                s.opening += 1
                if s.opening == len(self.start_ids):
                    s.opening, s.thinking = -1, True
                    s.forced = 0 if self.budget == 0 else -1
                self.history.append((before, False))
                return True
            s.opening = -1  # not thinking: this token is the answer's first
        if not s.thinking:
            if not self.inner.accept_token(token_id):
                self.state = before
                return False
            self.history.append((before, True))
            return True
        if s.forced >= 0 and token_id != self.end_ids[s.forced]:
            return False
        self.history.append((before, False))
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
            inner += to_inner
            self.state = before
        if inner:
            self.inner.rollback(inner)

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        s = self.state
        if s.opening > 0:
            set_only_token(mask, row, self.start_ids[s.opening])
        elif s.opening == 0:  # the answer's first token, or the start of the thoughts
            self.inner.fill_vocab_mask(mask, row)
            token = self.start_ids[0]
            bit = 1 << (token % 32)
            word = int(mask[row, token // 32]) & 0xFFFFFFFF | bit
            mask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
        elif not s.thinking:
            self.inner.fill_vocab_mask(mask, row)
        elif s.forced >= 0:
            set_only_token(mask, row, self.end_ids[s.forced])
        # thinking freely: the row stays all-allowed

    def is_terminated(self) -> bool:
        s = self.state
        return not s.thinking and s.opening < 0 and self.inner.is_terminated()

    def copy(self) -> ReasonerMatcher:
        other = ReasonerMatcher(self.inner.copy(), self.end_ids, self.budget, self.start_ids)
        other.state = self.state.copy()
        other.history = [(b.copy(), t) for b, t in self.history]
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
        fmt = REASONING_FORMATS.get(reasoning_parser or "")
        end = think_end_token or (fmt.end if fmt is not None else None)
        if not end:
            raise ValueError(
                "--grammar-backend reasoner needs --think-end-token or --reasoning-parser "
                f"({', '.join(REASONING_FORMATS)})"
            )
        self.end_ids = tokenizer.encode(end, add_special_tokens=False)
        if not self.end_ids:
            raise ValueError(f"think-end token {end!r} encodes to no tokens")
        # With a preset, a prompt that opened no thoughts lets the output choose (its first
        # token); with --think-end-token alone the output is taken to start in its thoughts.
        self.tokenizer = tokenizer
        self.format = ReasoningFormat(fmt.start, end) if fmt is not None else None
        # The output may open its thoughts only where the start marker is one token (Qwen3's,
        # DeepSeek-R1's): allowing the first of several ids ("<") would let any answer that
        # begins with it be taken for thoughts.
        start_ids = tokenizer.encode(fmt.start, add_special_tokens=False) if fmt else []
        self.start_ids = start_ids if len(start_ids) == 1 else []
        self.budget = think_budget
        self.inner = plugins.resolve("grammar_backend", inner)(
            tokenizer, vocab_size, stop_token_ids, **options
        )

    def compile(self, kind: str, text: str) -> Any:
        return self.inner.compile(kind, text)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return ReasonerMatcher(self.inner.matcher(compiled), self.end_ids, self.budget)

    def matcher_for(self, compiled: Any, prompt_ids: list[int]) -> GrammarMatcher:
        """Inside the thoughts from the start when the prompt's tail opened them (the chat
        template did: DeepSeek-R1, Qwen3's thinking variants); else the output chooses."""
        opening = None
        if self.format is not None:
            tail = self.tokenizer.decode(prompt_ids[-64:])
            if not starts_in_reasoning(self.format, tail):
                opening = self.start_ids
        return ReasonerMatcher(self.inner.matcher(compiled), self.end_ids, self.budget, opening)

    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        return self.inner.allocate_vocab_mask(batch_size)

    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.inner.apply_vocab_mask(logits, mask)
