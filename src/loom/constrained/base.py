"""The grammar_backend family (structured output).

A backend compiles a constraint — ``kind`` in ``json_schema | regex | ebnf | structural_tag`` and
its text — into a grammar, and makes per-request matchers from it. Each decode step the scheduler
asks every constrained request's matcher to fill its row of a token bitmask (on the host, while
the device runs the forward pass), applies the mask to the logits in place with the library's own
kernel, samples, and feeds the chosen token back with ``accept_token``. A matcher that reaches
its grammar's end (``is_terminated``) finishes its request.

Built-ins (``--grammar-backend``): ``xgrammar`` (default), ``llguidance``, ``none`` (structured
output off: constrained requests get a 400), and ``reasoner``, which wraps either of the first two
(``--reasoner-grammar-backend``) and leaves output free until the think-end token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarMatcher(ABC):
    """Per-request matcher state over one compiled grammar.

    Invariants (``loom.testing.check_grammar_backend``): ``accept_token`` returns False (and
    leaves the state unchanged) for a token the grammar forbids; ``rollback(k)`` undoes the last
    k accepted tokens; ``fill_vocab_mask`` writes this matcher's allowed-token bitmask into row
    ``row`` of ``mask`` and never touches other rows; ``copy`` gives an independent matcher in
    the same state (for ``n > 1``).
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None: ...

    @abstractmethod
    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None: ...

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def copy(self) -> GrammarMatcher: ...


class GrammarBackend(ABC):
    """Compiles constraints into matchers.

    ``compile`` may be slow and is called off the scheduler loop (a thread pool; the caller
    caches results by (kind, text)); an invalid constraint raises ValueError naming the problem.
    ``tokenizer`` is the model's HF tokenizer, ``vocab_size`` the width of the logits (may exceed
    the tokenizer's), ``stop_token_ids`` the ids that end generation (EOS).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int] | None = None,
        **options: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self.options = options
        self._token_texts: list[str] | None = None

    def token_texts(self) -> list[str]:
        """Each token id's text, decoded alone (one decode per id of the tokenizer's
        vocabulary, ~0.5 s for 49k ids: computed once, on first use, by whichever of its users
        asks first, all of them on the grammar manager's threads)."""
        if self._token_texts is None:
            tok = self.tokenizer
            n = min(len(tok), self.vocab_size)
            self._token_texts = [tok.decode([i]) for i in range(n)]
        return self._token_texts

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def matcher_for(self, compiled: Any, prompt_ids: list[int]) -> GrammarMatcher:
        """The matcher of a request whose prompt is ``prompt_ids`` (the scheduler's call; a
        backend whose start state depends on the prompt overrides it)."""
        return self.matcher(compiled)

    @abstractmethod
    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        """A host bitmask for ``batch_size`` rows (int32, 32 tokens per word), all allowed."""

    @abstractmethod
    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Set disallowed logits to -inf in place; ``mask`` is on ``logits``' device."""

    def fill_vocab_masks(
        self, matchers: list[GrammarMatcher], mask: torch.Tensor, rows: list[int]
    ) -> None:
        """Fill ``mask[rows[i]]`` for ``matchers[i]``; backends override this to fill the batch
        in parallel (the library's own threads)."""
        for m, row in zip(matchers, rows, strict=True):
            m.fill_vocab_mask(mask, row)

    @staticmethod
    def reset_vocab_mask(mask: torch.Tensor) -> None:
        mask.fill_(-1)  # every bit set: everything allowed


class GrammarError(ValueError):
    """A constraint that cannot be compiled (HTTP 400)."""
