"""SGLang's ``stop_regex``: generation stops once the output text matches a pattern.

The front end checks each request's text as it grows (``engine/outputs.py``). A check is bounded:
a pattern whose matches read at most ``max_len`` characters from where they begin (from its parse
tree, as SGLang bounds its tail window) is searched only over the new text and the ``max_len``
characters before it; a pattern with unbounded repetition (``\\d+``, ``.*``) is searched over the whole output, so
each check costs time linear in the output's length. The stop point is exact to the character:
the earliest end of the text at which it holds a match (a pattern such as ``[.!?]\\s*$`` that
looks at where the text ends is tried at every new end).

Patterns run on the ``regex`` package (Python's ``re`` syntax, with a time limit on every
search: a pathological pattern fails its own request instead of stalling the front end). SGLang's
limits apply: at most 32 patterns of at most 256 UTF-8 bytes each.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any

try:  # Python 3.11+
    import re._constants as _sre
    import re._parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

MAX_PATTERNS = 32
MAX_PATTERN_BYTES = 256
SEARCH_TIMEOUT_S = 0.25  # one search; past it the request fails (its pattern is pathological)

# Zero-width assertions whose answer depends on what follows the match: with them, text that
# did not match may match once it is cut shorter, so every new end is tried.
_END_ASSERTIONS = {_sre.AT_END, _sre.AT_END_STRING, _sre.AT_BOUNDARY, _sre.AT_NON_BOUNDARY}
for _name in ("AT_UNI_BOUNDARY", "AT_UNI_NON_BOUNDARY", "AT_LOC_BOUNDARY", "AT_LOC_NON_BOUNDARY"):
    if hasattr(_sre, _name):
        _END_ASSERTIONS.add(getattr(_sre, _name))
_ONE_CHAR = {_sre.LITERAL, _sre.NOT_LITERAL, _sre.IN, _sre.ANY}
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT} | (
    {_sre.POSSESSIVE_REPEAT} if hasattr(_sre, "POSSESSIVE_REPEAT") else set()
)
_UNBOUNDED = float("inf")


@dataclass(frozen=True)
class StopRegex:
    """A compiled ``stop_regex`` pattern and what bounds its search."""

    pattern: str
    compiled: Any  # regex.Pattern
    max_len: float  # how far past its start a match reads, in characters (inf: unbounded)
    end_sensitive: bool  # $, \\Z, \\b, \\B or a lookahead: a match depends on where text ends

    def _search(self, text: str, pos: int, endpos: int, partial: bool = False):
        try:
            return self.compiled.search(
                text, pos, endpos, partial=partial, timeout=SEARCH_TIMEOUT_S
            )
        except TimeoutError:
            raise ValueError(
                f"stop_regex {self.pattern!r} took longer than {SEARCH_TIMEOUT_S} s to search "
                "the output"
            ) from None

    def _pos(self, checked: int) -> int:
        """Where a match that ends after ``checked`` characters can start, at the earliest."""
        return 0 if self.max_len == _UNBOUNDED else max(0, checked - int(self.max_len))

    def first_match(self, text: str, checked: int) -> tuple[int, int] | None:
        """(start, end) of the match in ``text[:e]`` for the smallest ``e > checked`` that has
        one (``text[:checked]`` is known to have none), or None."""
        n, pos = len(text), self._pos(checked)
        if n <= checked:
            return None
        if self.end_sensitive:
            for e in range(checked + 1, n + 1):
                m = self._search(text, pos, e)
                if m is not None:
                    return m.span()
            return None
        m = self._search(text, pos, n)
        if m is None or m.end() <= checked:  # (the latter: an empty match, found at once)
            return None if m is None else m.span()
        # Without end assertions, "text[:e] holds a match" only turns true as e grows:
        # bisect for the first e (the match found above ends at or after it).
        ends = range(checked + 1, m.end() + 1)
        k = bisect.bisect_left(ends, True, key=lambda e: self._search(text, pos, e) is not None)
        return self._search(text, pos, ends[k]).span()

    def partial_start(self, text: str, checked: int) -> int | None:
        """Where a match could begin if the text went on (``text`` holds no match): the start of
        the leftmost partial match, or None. A stream holds back the text from there."""
        m = self._search(text, self._pos(checked), len(text), partial=True)
        return m.start() if m is not None and m.partial else None


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> StopRegex:
    """The pattern compiled and bounded, or a ValueError that says what is wrong with it."""
    size = len(pattern.encode("utf-8", "surrogatepass"))
    if size > MAX_PATTERN_BYTES:
        raise ValueError(f"is {size} bytes, over the {MAX_PATTERN_BYTES}-byte limit")
    try:
        tree = _sre_parse.parse(pattern)
    except Exception as e:  # noqa: BLE001 - re.error, RecursionError, OverflowError
        raise ValueError(f"is not a valid regular expression: {e}") from None
    import regex

    try:
        compiled = regex.compile(pattern, flags=regex.VERSION0)
    except Exception as e:  # noqa: BLE001 - regex.error and the like
        raise ValueError(f"is not a valid regular expression: {e}") from None
    max_len, end_sensitive = _analyse(tree)
    return StopRegex(pattern, compiled, max_len, end_sensitive)


def _analyse(tree) -> tuple[float, bool]:
    """(how far past its start a match reads, in characters: what it consumes and what its
    assertions look at; whether an assertion looks past the match's end)."""
    total, sensitive = 0.0, False
    for op, value in tree:
        if op in _ONE_CHAR:
            total += 1
        elif op == _sre.AT:
            if value in _END_ASSERTIONS:  # (it reads the character after it)
                total, sensitive = total + 1, True
        elif op == _sre.SUBPATTERN:
            length, s = _analyse(value[-1])
            total, sensitive = total + length, sensitive or s
        elif op == getattr(_sre, "ATOMIC_GROUP", None):
            length, s = _analyse(value)
            total, sensitive = total + length, sensitive or s
        elif op == _sre.BRANCH:
            parts = [_analyse(b) for b in value[1]]
            total += max(length for length, _ in parts)
            sensitive |= any(s for _, s in parts)
        elif op in _REPEATS:
            _, hi, inner = value
            length, s = _analyse(inner)
            sensitive |= s
            if hi == _sre.MAXREPEAT:
                total = _UNBOUNDED if length else total
            else:
                total += hi * length
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            direction, inner = value
            length, s = _analyse(inner)
            if direction == 1:  # a lookahead reads past the match
                total, sensitive = total + length, True
            sensitive |= s
        else:  # back-references, conditionals: no bound known
            total = _UNBOUNDED
    return total, sensitive
