"""Grammar compilation off the scheduler loop: a thread pool, results cached by (kind, text).

The front end compiles a request's constraint before submitting it (so an invalid one is a 400
at once, and the cache is warm); the scheduler keeps its own manager (it may live in another
process), parks the request in its grammar queue until the compile future resolves, and never
blocks the batch on it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from loom.constrained.base import GrammarBackend, GrammarError


class NoGrammarBackend(GrammarBackend):
    """``--grammar-backend none``: structured output is off; constrained requests get a 400."""

    def compile(self, kind, text):
        raise GrammarError(
            f"{kind} needs a grammar backend; this server runs --grammar-backend none"
        )

    def matcher(self, compiled):
        raise GrammarError("structured output is disabled")

    def allocate_vocab_mask(self, batch_size):
        raise GrammarError("structured output is disabled")

    def apply_vocab_mask(self, logits, mask):
        raise GrammarError("structured output is disabled")


class GrammarManager:
    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        max_workers: int = 2,
        cache_size: int = 1024,
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loom-grammar")
        self._backend: Future = self._pool.submit(make_backend)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size

    @property
    def backend(self) -> GrammarBackend:
        return self._backend.result()

    def submit(self, kind: str, text: str) -> Future:
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fut

    def run(self, fn: Callable[[], Any]) -> Future:
        """``fn`` on the manager's threads (work that needs the backend and must not run on
        the scheduler loop)."""
        return self._pool.submit(fn)

    def _compile(self, kind: str, text: str) -> Any:
        return self.backend.compile(kind, text)

    def compile(self, kind: str, text: str, timeout: float | None = None) -> Any:
        """Compile (or fetch from the cache) and wait; raises GrammarError / TimeoutError."""
        return self.submit(kind, text).result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_grammar_backend(
    args: Any, tokenizer: Any, vocab_size: int, stop_token_ids
) -> GrammarBackend:
    """The backend ``args.grammar_backend`` names (``args``: the grammar section of the server
    arguments), with the reasoner's options when it is one. With ``--reasoning-parser`` the
    named backend is wrapped in the reasoner, so that constraints apply after the thoughts."""
    from loom import plugins

    name, inner = args.grammar_backend, args.reasoner_grammar_backend
    if args.reasoning_parser and name not in ("reasoner", "none"):
        name, inner = "reasoner", args.grammar_backend
    cls = plugins.resolve("grammar_backend", name)
    options: dict[str, Any] = {}
    if name == "reasoner":
        options = dict(
            inner=inner,
            think_end_token=args.think_end_token,
            reasoning_parser=args.reasoning_parser,
            think_budget=args.think_budget,
        )
    return cls(tokenizer, vocab_size, sorted(stop_token_ids or []), **options)
