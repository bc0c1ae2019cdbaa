"""The front end's half of a request: chat templates, tokenisation and incremental
detokenisation (correct when a multi-byte character spans tokens)."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from loom.sampling.limits import ParamError

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation equals
    ``decode(ids)``, holding back text that ends in an incomplete UTF-8 sequence until a later
    token completes it (or the request ends: then it is given as ``decode`` gives it, U+FFFD).

    A fast tokenizer without the clean-up step goes through its Rust ``DecodeStream``, one
    ``step`` per token (0.74 us a token against 1.92 for the window below, on the CPU machine
    over 4,000 tokens of README text). Otherwise it decodes a short window
    ``ids[prefix_offset:]`` and emits only what extends the window's previously decoded text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.skip_special_tokens = skip_special_tokens
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._backend = _rust_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = 0  # characters handed out (the stream path)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """The text ``new_ids`` add (given all at once or one at a time, the same in the end)."""
        if self._stream is not None:
            return self._add_streamed(new_ids, final)
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def _add_streamed(self, new_ids: list[int], final: bool) -> str:
        parts = []
        for i in new_ids:
            self.ids.append(i)
            piece = self._stream.step(self._backend, i)
            if piece:
                parts.append(piece)
                self.read_offset = len(self.ids)
        text = "".join(parts)
        self.emitted += len(text)
        if final and self.read_offset < len(self.ids):
            # held-back tokens at the end: their text as the whole decode gives it
            tail = self._decode(self.ids)[self.emitted :]
            self.emitted += len(tail)
            self.read_offset = len(self.ids)
            text += tail
        return text


def _rust_backend(tokenizer: Any) -> Any | None:
    """A fast tokenizer's Rust ``tokenizers.Tokenizer`` where its ``decode`` is what
    ``tokenizer.decode`` gives (no clean-up step); else None."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return None
    return backend


def _decoder(tokenizer: Any, skip_special_tokens: bool):
    """``ids -> text`` as ``tokenizer.decode`` gives it: the Rust backend's ``decode`` where
    there is one, called directly (1.5 us a call against 4 us through transformers)."""
    backend = _rust_backend(tokenizer)
    decode = backend.decode if backend is not None else tokenizer.decode
    return functools.partial(decode, skip_special_tokens=skip_special_tokens)


class TokenizerManager:
    def __init__(self, tokenizer: Any, context_len: int, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.chat_template = load_chat_template(chat_template) or getattr(
            tokenizer, "chat_template", None
        )

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        return ids

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of ``messages`` (and the tools' definitions, OpenAI's
        ``{"type": "function", "function": ...}`` objects) through the chat template;
        ``template_kwargs`` go to the template (e.g. Qwen3's ``enable_thinking``)."""
        if not messages:
            raise ValueError("messages must not be empty")
        if self.chat_template is None:
            raise ValueError("this model has no chat template (give one with --chat-template)")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise ParamError("messages", f"messages[{i}] must be an object")
            for key, value in msg.items():
                if isinstance(value, str):
                    _check_text(value, f"messages[{i}].{key}", "messages")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as e:  # noqa: BLE001 - jinja's errors: the template refused the input
            if isinstance(e, ParamError):
                raise
            raise ParamError("messages", f"the chat template failed: {e}") from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        _check_text(text, "prompt", "prompt")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's path, or the template's text."""
    if value is None:
        return None
    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: no file {value!r} (nor is it a Jinja template)")
    return value


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
