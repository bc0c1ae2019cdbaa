"""The grammar_backend family (structured output). Built-ins arrive with the grammar issue."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class GrammarMatcher(ABC):
    """Per-request matcher state over one compiled grammar.

    Invariants: ``accept_token`` returns False (and leaves the state unchanged) for a token the
    grammar forbids; ``rollback(k)`` undoes the last k accepted tokens; ``fill_vocab_mask`` writes
    this matcher's allowed-token bitmask into row ``row`` of ``mask`` and never touches other rows;
    ``copy`` gives an independent matcher in the same state (for ``n > 1``).
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
    """Compiles constraints (kind in json_schema | regex | ebnf | structural_tag) into matchers.

    ``compile`` may be slow and is called off the scheduler loop; results are cached by
    (kind, text). An invalid constraint raises ValueError naming the problem.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, **options: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.options = options

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abstractmethod
    def allocate_vocab_mask(self, batch_size: int, device: torch.device) -> torch.Tensor: ...

    @abstractmethod
    def apply_vocab_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None: ...
