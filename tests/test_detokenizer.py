from __future__ import annotations

import pytest

from loom.engine import tokenizer_manager
from loom.engine.tokenizer_manager import IncrementalDetokenizer

TEXTS = [
    "héllo wörld — ça va? 日本語のテキスト 🙂🚀 ok",
    "emoji only: 👩‍👩‍👧‍👦🏳️‍🌈",
    "plain ascii text with   spaces\nand newlines",
]


@pytest.fixture(params=["stream", "window"])
def path(request, monkeypatch):
    """Both ways of detokenising: the Rust DecodeStream, and the decoded window (what a
    tokenizer without a DecodeStream backend takes)."""
    if request.param == "window":
        monkeypatch.setattr(tokenizer_manager, "_rust_backend", lambda tokenizer: None)
    return request.param


def _detok(tok, path) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok)
    assert (d._stream is not None) == (path == "stream")
    return d


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(engine, text, path):
    tok = engine.tokenizer
    ids = tok.encode(text)
    detok = _detok(tok, path)
    deltas = [detok.add([i], final=(n == len(ids) - 1)) for n, i in enumerate(ids)]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # multi-byte characters span tokens here, so some steps must have been held back
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas


@pytest.mark.parametrize("text", TEXTS)
def test_uneven_chunks_and_an_end_inside_a_character(engine, text, path):
    """Ids in chunks of 1-3 (a front end that fell behind) give the same text; a request that
    ends inside a multi-byte character gets that character as decode gives it (U+FFFD)."""
    tok = engine.tokenizer
    ids = tok.encode(text)
    for end in range(1, len(ids) + 1):
        detok = _detok(tok, path)
        got, k = "", 0
        while k < end:
            step = ids[k : min(end, k + 1 + k % 3)]
            k += len(step)
            got += detok.add(step, final=k == end)
        assert got == tok.decode(ids[:end]), end
