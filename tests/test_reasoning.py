"""The reasoning parser against hand-written splits, and streaming against the whole-text split
at every cut of the text."""

from __future__ import annotations

import pytest

from loom.reasoning import REASONING_FORMATS, ReasoningParser, starts_in_reasoning

R1 = REASONING_FORMATS["deepseek-r1"]
KIMI = REASONING_FORMATS["kimi"]

CASES = [
    # (format, starts inside the thoughts, output, reasoning, content)
    (R1, True, "Let me think.</think>\n\nParis.", "Let me think.", "Paris."),
    (R1, False, "<think>Hmm, France.</think>\n\nParis.", "Hmm, France.", "Paris."),
    (R1, False, "\n<think>a</think>b", "a", "b"),
    (R1, False, "Paris.", "", "Paris."),
    (R1, False, "The <think> tag is literal here.", "", "The <think> tag is literal here."),
    (R1, True, "cut off before the end", "cut off before the end", ""),
    (R1, False, "<think>still thinking", "still thinking", ""),
    (R1, True, "</think>", "", ""),
    (R1, False, "<thi", "", "<thi"),
    (R1, True, "a </thin b</think>c</think>d", "a </thin b", "c</think>d"),
    (KIMI, False, "◁think▷x◁/think▷y", "x", "y"),
]


@pytest.mark.parametrize("fmt,inside,text,reasoning,content", CASES)
def test_split(fmt, inside, text, reasoning, content):
    assert ReasoningParser(fmt, inside).split(text) == (reasoning, content)


@pytest.mark.parametrize("fmt,inside,text,reasoning,content", CASES)
def test_streaming_equals_split_at_every_cut(fmt, inside, text, reasoning, content):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            p = ReasoningParser(fmt, inside)
            parts = [p.feed(text[:i]), p.feed(text[i:j]), p.feed(text[j:]), p.finish()]
            got = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
            assert got == (reasoning, content), (i, j)


def test_streaming_never_releases_a_marker_fragment():
    text = "<think>abc</think>\n\nanswer"
    p = ReasoningParser(R1, False)
    for ch in text:
        r, c = p.feed(ch)
        assert "<" not in r + c and ">" not in r + c


@pytest.mark.parametrize(
    "prompt,inside",
    [
        ("<|Assistant|><think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("user: <think>x</think> assistant: <think>", True),
    ],
)
def test_starts_in_reasoning(prompt, inside):
    assert starts_in_reasoning(R1, prompt) is inside
