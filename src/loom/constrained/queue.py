"""The scheduler's grammar queue: constrained requests wait here, off the batch, while their
grammar compiles on the manager's threads; a compiled one gets its matcher and moves on.

A request is duck-typed: ``rid``, ``sampling_params.constraint`` (kind, text), and the fields
set here, ``grammar_future``, ``grammar_deadline`` and ``grammar``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from loom.constrained.base import GrammarBackend
from loom.constrained.closing import BudgetCloser, due_rows
from loom.constrained.manager import GrammarManager, build_grammar_backend
from loom.constrained.reasoner import ReasonerBackend

logger = logging.getLogger(__name__)


def grammar_backend_factory(
    args, tokenizer_path: str | None, runner, stop_token_ids: set[int]
) -> Callable[[], GrammarBackend]:
    """What builds the ``--grammar-backend`` (``args``: the grammar section) for ``runner``'s
    model: its tokenizer (from ``tokenizer_path`` or the model) and vocabulary, with
    ``stop_token_ids`` ending a grammar."""

    def make() -> GrammarBackend:
        path = tokenizer_path or runner.model_path
        tokenizer = runner.loader.load_tokenizer(path)
        if tokenizer is None:
            raise ValueError(f"no tokenizer at {path}")
        return build_grammar_backend(args, tokenizer, runner.vocab_size, set(stop_token_ids))

    return make


class GrammarQueue:
    """``make_backend`` builds the grammar backend (on first use, on the manager's threads);
    ``timeout``: seconds a compile may take before its request fails; ``close_mode``: the
    server's ``--structured-output-close-within-budget``."""

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        timeout: float,
        close_mode: str = "json_schema",
    ) -> None:
        self.make_backend = make_backend
        self.timeout = timeout
        self.close_mode = close_mode
        self.reqs: list = []
        self._mgr: GrammarManager | None = None
        self._closer: Future | None = None

    def close_within_budget(self, reqs, rows: list[int], mask, out_lens: list[int]) -> None:
        """``BudgetCloser.close_rows`` for the rows of a step's filled mask that are due
        (``due_rows``; never under the reasoner, whose thoughts end with a marker the character
        search does not write). The closer is built on the manager's threads beside the first
        compile; a step waits for it only when a row is due before it is ready."""
        due = due_rows(reqs, rows, out_lens, self.close_mode)
        if not due or self._closer is None:
            return
        closer = self._closer.result()
        if closer is not None:
            closer.close_rows(reqs, due, mask, out_lens)

    def _build_closer(self) -> BudgetCloser | None:
        backend = self.manager.backend
        if isinstance(backend, ReasonerBackend):
            return None
        try:
            return BudgetCloser(backend)
        except Exception:  # closing is then off; constrained answers are still the grammar's
            logger.exception("closing within the budget is off: its vocabulary index failed")
            return None

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self):
        return iter(self.reqs)

    @property
    def manager(self) -> GrammarManager:
        if self._mgr is None:
            self._mgr = GrammarManager(self.make_backend)
        return self._mgr

    @property
    def backend(self) -> GrammarBackend:
        return self.manager.backend

    def submit(self, req) -> None:
        """Start compiling the request's constraint and park it (raises if the backend cannot
        be built or refuses the submission)."""
        req.grammar_future = self.manager.submit(*req.sampling_params.constraint)
        if self._closer is None and (
            self.close_mode != "off" or req.sampling_params.close_within_budget
        ):
            self._closer = self.manager.run(self._build_closer)
        req.grammar_deadline = time.monotonic() + self.timeout
        self.reqs.append(req)

    def poll(self) -> tuple[list, list[tuple[object, str]]]:
        """The requests whose grammar compiled (matcher attached, in arrival order) and those
        that failed, with the reason; the rest keep waiting."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for req in self.reqs:
            fut = req.grammar_future
            if fut.done():
                try:
                    req.grammar = self.backend.matcher_for(fut.result(), req.origin_input_ids)
                except Exception as e:  # noqa: BLE001 - GrammarError or the library's own
                    failed.append((req, f"grammar compilation failed: {e}"))
                    continue
                req.grammar_future = None
                ready.append(req)
            elif now > req.grammar_deadline:
                failed.append((req, f"grammar compilation timed out after {self.timeout} s"))
            else:
                still.append(req)
        self.reqs = still
        return ready, failed

    def take(self, rids: set[str]) -> list:
        """Remove and return the queued requests whose id is in ``rids``."""
        out = [r for r in self.reqs if r.rid in rids]
        if out:
            self.reqs = [r for r in self.reqs if r.rid not in rids]
        return out

    def remove(self, req) -> None:
        self.reqs = [r for r in self.reqs if r is not req]

    def clear(self) -> None:
        self.reqs = []

    def wait(self, timeout: float) -> None:
        """Block until one compile finishes, at most ``timeout`` seconds."""
        wait([r.grammar_future for r in self.reqs], timeout, FIRST_COMPLETED)

    def close(self) -> None:
        if self._mgr is not None:
            self._mgr.close()
