from __future__ import annotations

import pytest

from loom.engine.tokenizer_manager import IncrementalDetokenizer

TEXTS = [
    "héllo wörld — ça va? 日本語のテキスト 🙂🚀 ok",
    "emoji only: 👩‍👩‍👧‍👦🏳️‍🌈",
    "plain ascii text with   spaces\nand newlines",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(engine, text):
    tok = engine.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i], final=(n == len(ids) - 1)) for n, i in enumerate(ids)]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # multi-byte characters span tokens here, so some steps must have been held back
    if any(ord(c) > 0x7FF for c in text):
        assert "" in deltas
