"""The front end's half of a request: chat templates, tokenisation and incremental
detokenisation (correct when a multi-byte character spans tokens)."""

from __future__ import annotations

import json
import os
from typing import Any

from loom.sampling.limits import ParamError

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a short window ``ids[prefix_offset:]`` and emits only what extends the window's
    previously decoded text, holding back text that ends in an incomplete UTF-8 sequence (U+FFFD)
    until the next token completes it. The concatenated deltas equal ``decode(ids)``.
    ``add`` decodes by itself; ``detokenize_batch`` advances many at once in one call.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def windows(self, new_ids: list[int]) -> tuple[list[int], list[int]]:
        """Take ``new_ids``; the two windows to decode: what was read, and all of it."""
        self.ids.extend(new_ids)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def advance(self, prefix_text: str, new_text: str, final: bool) -> str:
        """The delta, given the two windows' texts."""
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def add(self, new_ids: list[int], final: bool = False) -> str:
        prefix, full = self.windows(new_ids)
        return self.advance(self._decode(prefix), self._decode(full), final)


def detokenize_batch(
    tokenizer: Any, items: list[tuple[IncrementalDetokenizer, list[int], bool]]
) -> list[str | Exception]:
    """The deltas of many detokenizers (``(detok, new_ids, final)``) in one decode call per
    ``skip_special_tokens`` value. A fast tokenizer's ``decode_batch`` runs in Rust without
    the interpreter lock, over the cores; others decode one window at a time. An item whose
    windows fail to decode gets its exception in place of its delta, the others their deltas."""
    pairs = [detok.windows(new_ids) for detok, new_ids, _ in items]
    texts: dict[int, tuple[str, str] | Exception] = {}
    for skip in (True, False):
        idx = [k for k, (detok, _, _) in enumerate(items) if detok.skip_special_tokens == skip]
        if not idx:
            continue
        flat = [w for k in idx for w in pairs[k]]
        try:
            decoded = _decode_all(tokenizer, flat, skip)
            for j, k in enumerate(idx):
                texts[k] = (decoded[2 * j], decoded[2 * j + 1])
        except Exception:  # noqa: BLE001 - find the items at fault, one by one
            for k in idx:
                try:
                    texts[k] = tuple(_decode_all(tokenizer, list(pairs[k]), skip))
                except Exception as e:  # noqa: BLE001 - that item's failure alone
                    texts[k] = e
    deltas: list[str | Exception] = []
    for k, (detok, _, final) in enumerate(items):
        t = texts[k]
        deltas.append(t if isinstance(t, Exception) else detok.advance(t[0], t[1], final))
    return deltas


def _decode_all(tokenizer: Any, windows: list[list[int]], skip: bool) -> list[str]:
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # what transformers' decode does for a fast tokenizer without the clean-up step
        return backend.decode_batch(windows, skip_special_tokens=skip)
    return [tokenizer.decode(w, skip_special_tokens=skip) for w in windows]


class TokenizerManager:
    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise ParamError("messages", f"messages[{i}] must be an object")
            for key, value in msg.items():
                if isinstance(value, str):
                    _check_text(value, f"messages[{i}].{key}", "messages")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        _check_text(text, "prompt", "prompt")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _check_text(text: str, where: str, param: str) -> None:
    """Text must be valid Unicode: a lone surrogate (``"\\ud800"`` in JSON) has no UTF-8 form,
    and tokenizers and chat templates fail on it deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("utf-8", "backslashreplace").decode()
        raise ParamError(
            param, f"{where} is not valid Unicode: {e.reason} at character {e.start} ({bad})"
        ) from None


def eos_token_ids(hf_config: Any, model_path: str, tokenizer: Any) -> set[int]:
    """The ids that end generation: the model config's ``eos_token_id``, its
    ``generation_config.json``'s, and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    gen_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_config):
        with open(gen_config) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids
