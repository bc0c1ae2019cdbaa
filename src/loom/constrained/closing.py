"""Closing within the budget: a constrained answer that would run out of tokens is steered onto a
short completion of its grammar, so that it ends valid within ``max_new_tokens``.

``BudgetCloser.restrict`` is called for a request's mask row once at most ``WINDOW`` tokens
remain. It walks the grammar's own states from the request's matcher (a copy), token by token,
depth first, trying at each state only what closes soonest:

- where the grammar allows at most ``FORCED`` tokens, all of them (a key name, ``true``, a
  required separator, a date's digit; llguidance allows only the canonical tokens of forced
  text), those starting with a closing character first, then with a filler (``1a``: a year
  0000 is no date);
- inside a string (more than ``FREE`` single characters allowed), the closing quote;
- elsewhere (between values) the single characters of ``}],":`` it allows, in that order: close
  the container, else a separator (a value is complete and more is required), else an empty
  string;

and where none of those is allowed (inside a pattern or a format), every allowed character: a
filler after which the grammar allows something else than now first, then those after which it
allows the fewest (the ``@`` of an email, the ``.`` of a domain), ties broken by ``1a`` then
character order. The first completion found is short, not
proven shortest. Its text is cut into the longest vocabulary entries; when those plus the stop
token no longer fit in the tokens left (with one to spare), the row allows only the first of
them (or the walk's own first token where the grammar refuses it) and, at the completion's end,
the stop tokens. The walk is repeated every step, so the answer follows it to the end.
"""

from __future__ import annotations

from typing import Any

import torch

WINDOW = 64  # the walk runs only when this many tokens or fewer remain
FORCED = 12  # at most this many allowed tokens: try them all
FREE = 50  # more than this many single characters allowed: inside a string
ORDER = '}],":'
FILLERS = "1a"
MAX_TOKENS = 256  # the longest completion walked
MAX_NODES = 600  # matcher states visited by one walk; none found within: no steering


class BudgetCloser:
    """Built from the grammar backend's tokenizer; one per scheduler."""

    def __init__(self, backend: Any) -> None:
        tok = backend.tokenizer
        special = set(getattr(tok, "all_special_ids", []) or [])
        self.by_text: dict[str, list[int]] = {}
        self.single: dict[str, int] = {}
        self.text: list[str] = []  # each id's text ("" for special and partial-character ids)
        for i, text in enumerate(backend.token_texts()):
            if i in special or "\ufffd" in text:
                text = ""
            self.text.append(text)
            if not text:
                continue
            self.by_text.setdefault(text, []).append(i)
            if len(text) == 1 and text.isprintable():
                self.single.setdefault(text, i)
        self.max_text = max(map(len, self.by_text), default=1)
        self.stop_ids = list(backend.stop_token_ids)
        self._row = backend.allocate_vocab_mask(1)
        self._reset = backend.reset_vocab_mask

    def _words(self, m) -> list[int]:
        """The mask words of ``m``'s next token."""
        self._reset(self._row)
        m.fill_vocab_mask(self._row, 0)
        return self._row[0].tolist()

    def _state(self, m) -> tuple[list[tuple[str, int]], bool]:
        """The tokens to try at ``m``'s state, in order, and whether it may end here."""
        words = self._words(m)

        def on(i: int) -> bool:
            return (words[i >> 5] >> (i & 31)) & 1 == 1

        can_end = m.is_terminated() or any(on(s) for s in self.stop_ids)
        single = {c: i for c, i in self.single.items() if on(i)}
        if len(single) > FREE:  # inside a string
            if '"' in single:
                return [('"', single['"'])], can_end
            return self._narrowing(m, single), can_end
        n = len(self.text)
        ids = [
            w * 32 + b
            for w, word in enumerate(words)
            if word
            for b in range(32)
            if (word >> b) & 1 and w * 32 + b < n
        ]
        if len(ids) > FORCED:
            tries = [(c, single[c]) for c in ORDER if c in single]
            return tries or self._narrowing(m, single), can_end
        rank = {c: k for k, c in enumerate(ORDER + FILLERS)}
        tokens = [(self.text[i], i) for i in ids if self.text[i]]
        tokens.sort(key=lambda t: (rank.get(t[0][0], len(rank)), len(t[0]), t[0]))
        return tokens, can_end

    def _narrowing(self, m, allowed: dict[str, int]) -> list[tuple[str, int]]:
        """The allowed characters in trial order: a filler (``FILLERS``) after which the
        grammar allows other characters than now (a date's month digit), then those after which
        it allows the fewest (a format's ``@`` or ``.``), ties broken by ``FILLERS`` then
        character order."""
        after: dict[str, frozenset[str]] = {}
        for c, i in allowed.items():
            if c == "\\" and len(allowed) > 1:
                continue  # (an escape only lengthens the string)
            if m.accept_token(i):
                words = self._words(m)
                after[c] = frozenset(
                    d for d, j in self.single.items() if (words[j >> 5] >> (j & 31)) & 1
                )
                m.rollback(1)
        now = frozenset(allowed)
        rank = {c: k for k, c in enumerate(FILLERS)}
        first = [c for c in FILLERS if c in after and after[c] != now][:1]
        rest = sorted(
            (c for c in after if c not in first),
            key=lambda c: (len(after[c]), rank.get(c, len(FILLERS)), c),
        )
        return [(c, allowed[c]) for c in first + rest]

    def completion(self, matcher) -> list[tuple[str, int]] | None:
        """A short completion of ``matcher``'s grammar (as above) as (text, token id) steps, or
        None when none is found within ``MAX_NODES`` states."""
        m = matcher.copy()
        budget = [MAX_NODES]

        def walk(depth: int) -> list | None:
            budget[0] -= 1
            if budget[0] < 0:
                raise _Exhausted
            tries, can_end = self._state(m)
            if can_end:
                return []
            if depth == 0:
                return None
            for text, tid in tries:
                if m.accept_token(tid):
                    rest = walk(depth - 1)
                    m.rollback(1)
                    if rest is not None:
                        return [(text, tid), *rest]
            return None

        try:
            return walk(MAX_TOKENS)
        except _Exhausted:
            return None

    def pieces(self, text: str) -> list[str]:
        """``text`` cut into vocabulary entries, the longest matching one each time."""
        out, i = [], 0
        while i < len(text):
            k = min(self.max_text, len(text) - i)
            while k > 1 and text[i : i + k] not in self.by_text:
                k -= 1
            out.append(text[i : i + k])
            i += k
        return out

    def restrict(self, matcher, mask: torch.Tensor, row: int, remaining: int) -> int | None:
        """Narrow ``mask[row]`` (already the grammar's) to the completion's next token when it
        must start now. Returns the slack: the tokens to spare beyond the completion, the stop
        token and one more (0: steered now; None: no completion found)."""
        steps = self.completion(matcher)
        if steps is None:
            return None
        pieces = self.pieces("".join(t for t, _ in steps))
        if len(pieces) + 2 < remaining:
            return remaining - len(pieces) - 2
        words = mask[row]

        def allowed(i: int) -> bool:
            return (int(words[i >> 5]) >> (i & 31)) & 1 == 1

        if not steps:
            ids = [i for i in self.stop_ids if allowed(i)]
        else:
            ids = [i for i in self.by_text.get(pieces[0], []) if allowed(i)][:1] or [steps[0][1]]
        if not ids:
            return None
        words.zero_()
        for i in ids:
            bit = 1 << (i & 31)
            words[i >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit
        return 0

    def close_rows(self, reqs, rows: list[int], mask: torch.Tensor, out_lens) -> None:
        """Steer the rows ``rows`` of ``reqs`` (those ``due_rows`` chose); a request steered
        for the first time records its output length in ``closed_at``. A walk that left a
        slack of s tokens is repeated s // 4 steps later (assuming a completion grows by less
        than four tokens a step), so a request far from its budget is walked rarely and one
        being steered every step."""
        for i in rows:
            req = reqs[i]
            remaining = req.sampling_params.max_new_tokens - out_lens[i]
            slack = self.restrict(req.grammar, mask, i, remaining)
            req.close_next = out_lens[i] + max(1, (slack or 0) // 4)
            if slack == 0 and req.closed_at is None:
                req.closed_at = out_lens[i]


def due_rows(reqs, rows: list[int], out_lens, mode: str) -> list[int]:
    """The rows of ``reqs`` among ``rows`` that want closing (``wants_closing`` under the
    server's ``mode``), have at most ``WINDOW`` tokens left and whose next walk is due."""
    due = []
    for i in rows:
        req = reqs[i]
        p = req.sampling_params
        if (
            p.max_new_tokens - out_lens[i] <= WINDOW
            and out_lens[i] >= req.close_next
            and wants_closing(p, mode)
        ):
            due.append(i)
    return due


def wants_closing(params, mode: str) -> bool:
    """A request's ``close_within_budget``, or the server's default ``mode``: ``json_schema``
    (JSON schemas, which Loom compiles strictly, tool calls included), ``all`` or ``off``."""
    if params.close_within_budget is not None:
        return params.close_within_budget
    return mode == "all" or (mode == "json_schema" and params.json_schema is not None)


class _Exhausted(Exception):
    pass
