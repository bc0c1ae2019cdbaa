"""Conformance kit of the grammar_backend family (needs a real tokenizer)."""

from __future__ import annotations

from typing import Any

import torch

from loom import plugins


def _allowed(mask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    bits = mask[row].to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, dtype=torch.int64)
    allowed = ((bits.unsqueeze(1) >> shifts) & 1).bool().flatten()
    return allowed[:vocab_size]


def check_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], **options: Any
) -> None:
    """With a real tokenizer: a regex's matcher allows only continuations of the pattern, fills
    only its own row of a shared mask, refuses a forbidden token without changing state, rolls
    back, copies independently, terminates after the pattern and a stop token (the decoded text
    matches the regex), and ``apply_vocab_mask`` sets exactly the forbidden logits to -inf.
    Invalid constraints raise ValueError."""
    import re

    backend = plugins.resolve("grammar_backend", name)(
        tokenizer, vocab_size, stop_token_ids, **options
    )
    for kind, bad_text in (("regex", "(unclosed"), ("json_schema", "{not json")):
        try:
            backend.compile(kind, bad_text)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: an invalid {kind} must raise ValueError")
    pattern = "[0-9]{3}-(ab|cd)"
    m = backend.matcher(backend.compile("regex", pattern))
    mask = backend.allocate_vocab_mask(3)
    backend.reset_vocab_mask(mask)
    m.fill_vocab_mask(mask, 1)
    assert torch.all(mask[0] == -1) and torch.all(mask[2] == -1), (
        f"{name}: fill_vocab_mask must touch only its own row"
    )
    first = _allowed(mask, 1, vocab_size)
    assert 0 < int(first.sum()) < vocab_size, f"{name}: a regex must restrict the first token"
    forbidden = int((~first).nonzero()[0])
    assert not m.accept_token(forbidden), f"{name}: accept_token must refuse a forbidden token"
    again = backend.allocate_vocab_mask(1)
    m.fill_vocab_mask(again, 0)
    assert torch.equal(again[0], mask[1]), f"{name}: a refused token must not change the state"
    # walk the grammar: the lowest allowed token each time, until it terminates
    accepted: list[int] = []
    for _ in range(32):
        if m.is_terminated():
            break
        row = backend.allocate_vocab_mask(1)
        m.fill_vocab_mask(row, 0)
        tok = int(_allowed(row, 0, vocab_size).nonzero()[0])
        if accepted == []:
            fork = m.copy()
        assert m.accept_token(tok), f"{name}: an allowed token must be accepted"
        accepted.append(tok)
    assert m.is_terminated(), f"{name}: the matcher must terminate after the pattern"
    text = tokenizer.decode([t for t in accepted if t not in stop_token_ids])
    assert re.fullmatch(pattern, text), f"{name}: generated {text!r} does not match {pattern}"
    # the copy taken before the first token is unaffected by what the original accepted
    row = backend.allocate_vocab_mask(1)
    fork.fill_vocab_mask(row, 0)
    assert torch.equal(row[0], mask[1]), f"{name}: copy() must be independent"
    # rollback to the start gives the initial mask again
    m.rollback(len(accepted))
    row = backend.allocate_vocab_mask(1)
    m.fill_vocab_mask(row, 0)
    assert torch.equal(row[0], mask[1]), f"{name}: rollback must restore the state"
    # the batch fill (the backend's parallel path) gives each row what its matcher gives alone
    others = [backend.matcher(backend.compile("regex", pat)) for pat in ("[a-z]+", "(yes|no)")]
    batch = backend.allocate_vocab_mask(4)
    backend.reset_vocab_mask(batch)
    backend.fill_vocab_masks([m, *others], batch, [3, 0, 2])
    for matcher, row in zip([m, *others], [3, 0, 2], strict=True):
        alone = backend.allocate_vocab_mask(1)
        matcher.fill_vocab_mask(alone, 0)
        assert torch.equal(batch[row], alone[0]), f"{name}: fill_vocab_masks row {row} differs"
    assert torch.all(batch[1] == -1), f"{name}: fill_vocab_masks touched a row it was not given"
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    want[1, ~first] = float("-inf")
    backend.apply_vocab_mask(logits, mask)
    assert torch.equal(logits, want), f"{name}: apply_vocab_mask must -inf exactly the forbidden"
