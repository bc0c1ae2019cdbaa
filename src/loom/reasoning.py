"""Reasoning models' thoughts, split from their answers (``--reasoning-parser``).

A reasoning model writes its thoughts between a start and an end marker (``<think>`` and
``</think>`` for DeepSeek-R1, Qwen3 and GLM-4.5), then the answer. Its chat template often opens
the thoughts itself, at the end of the prompt (DeepSeek-R1's always does, Qwen3's thinking
variants too), so the output starts inside them with no start marker; a template asked not to
think (Qwen3's ``enable_thinking=False``) closes an empty block in the prompt instead. Which case
holds is read from the prompt's text: the output starts inside the thoughts when the prompt's
last marker is an unclosed start marker. Otherwise thoughts are recognised only when the output
itself opens with the start marker.

An output cut before its end marker (``length``) is all thoughts, as in SGLang and vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("<think>", "</think>"),
    "qwen3": ReasoningFormat("<think>", "</think>"),
    "glm45": ReasoningFormat("<think>", "</think>"),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),
}


def starts_in_reasoning(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether generation after ``prompt`` begins inside the thoughts (the template opened them)."""
    start, end = prompt.rfind(fmt.start), prompt.rfind(fmt.end)
    return start >= 0 and start > end


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (text that
    may still turn into the marker, so it cannot be released yet)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Splits one output's text, whole (:meth:`split`) or as it streams (:meth:`feed`), into
    reasoning and content. Feeding any split of a text and then :meth:`finish` gives exactly
    what :meth:`split` gives for it."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        # "open": before the output shows whether it thinks; "think": inside; "answer": after
        self._state = "think" if in_reasoning else "open"
        self._pending = ""

    def split(self, text: str) -> tuple[str, str]:
        reasoning, content = self.feed(text)
        more_r, more_c = self.finish()
        return reasoning + more_r, content + more_c

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) released by ``delta``; text that may be part of a marker is held
        until the next call shows what it is."""
        text = self._pending + delta
        self._pending = ""
        reasoning = content = ""
        if self._state == "open":
            stripped = text.lstrip()
            if stripped.startswith(self.fmt.start):
                self._state = "think"
                text = stripped[len(self.fmt.start) :]
            elif self.fmt.start.startswith(stripped):  # maybe the start marker, still arriving
                self._pending = text
                return "", ""
            else:
                self._state = "answer"
        if self._state == "think":
            at = text.find(self.fmt.end)
            if at < 0:
                keep = _held(text, self.fmt.end)
                self._pending = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning = text[:at]
            text = text[at + len(self.fmt.end) :].lstrip("\n")
            self._state = "answer"
            if not text:
                self._state = "answer_start"
                return reasoning, ""
        if self._state == "answer_start":  # the newlines after the end marker are not content
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self._state = "answer"
        content = text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: unfinished thoughts stay thoughts."""
        text, self._pending = self._pending, ""
        if self._state == "think":
            return text, ""
        return "", text if self._state in ("open", "answer") else ""
