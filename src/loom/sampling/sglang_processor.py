"""SGLang's client-sent custom logit processors, for servers started with
``--enable-custom-logit-processor`` (off by default: a payload is code the client chose, and
loading it runs that code on the server). Named processors installed on the server
(``logits_processor.py``) are the safe way and stay the default.

The payload is what SGLang's ``CustomLogitProcessor.to_str()`` makes: the JSON
``{"callable": "<hex of dill.dumps(cls)>"}``. As SGLang does, Loom rebuilds the class and
instantiates it, once per distinct payload (an LRU cache of ``CACHE_SIZE`` instances), and calls
it once per step for all the rows that sent that payload::

    processor(logits, custom_param_list) -> logits

``logits`` is ``[rows, vocab]``; ``custom_param_list[i]`` is row i's ``custom_params`` with
``"__req__"`` added (``None`` when the request gave no ``custom_params``, as in SGLang). The dict
is the request's own for its whole life, so a processor may keep state in it between steps.
``"__req__"`` is a ``ReqView`` with the fields SGLang's processors read from its ``Req``.

A payload names SGLang's module ``sglang.srt.sampling.custom_logit_processor`` for its base
class (and for SGLang's own processors, sent by reference). Loom resolves those names to this
module, which has the same classes, so the server does not need SGLang installed (importing it
would patch transformers in Loom's process).
"""

from __future__ import annotations

import collections
import io
import json
import threading
import weakref
from abc import ABC, abstractmethod
from typing import Any

import torch

SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"
CACHE_SIZE = 64


def is_serialized(name: Any) -> bool:
    """Whether ``custom_logit_processor`` is SGLang's serialised form, not a plug-in's name."""
    return isinstance(name, str) and name.lstrip().startswith("{") and '"callable"' in name


class ReqView:
    """``custom_params["__req__"]``: a live, read-only view of the request (SGLang passes its
    ``Req``). ``origin_input_ids`` and ``output_ids`` are the request's own lists: read them,
    do not change them."""

    __slots__ = ("_req",)

    def __init__(self, req: Any) -> None:
        self._req = weakref.proxy(req)

    @property
    def rid(self) -> str:
        return self._req.rid

    @property
    def origin_input_ids(self) -> list[int]:
        return self._req.origin_input_ids

    @property
    def output_ids(self) -> list[int]:
        return self._req.output_ids

    @property
    def sampling_params(self) -> Any:
        return self._req.sampling_params

    def finished(self) -> bool:
        return self._req.is_finished


class CustomLogitProcessor(ABC):
    """SGLang's base class (the same contract, under the name payloads refer to)."""

    @abstractmethod
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None
    ) -> torch.Tensor: ...

    @classmethod
    def to_str(cls) -> str:
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        return load(json_str).processor


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Bans ``custom_params["token_ids"]`` (the same list for every row, as SGLang requires)."""

    def __call__(self, logits, custom_param_list=None):
        ids = custom_param_list[0]["token_ids"]
        if any(p["token_ids"] != ids for p in custom_param_list):
            raise ValueError("DisallowedTokensLogitsProcessor: rows disagree on token_ids")
        logits[..., ids] = float("-inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """Ends an open thinking block after ``custom_params["thinking_budget"]`` tokens: forces a
    newline, then the think-end token. Subclasses give the model's three token ids."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or []):
            budget = (params or {}).get("thinking_budget")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            req = params["__req__"]
            ids = [*req.origin_input_ids, *req.output_ids]
            start = _open_block(ids, self.THINKING_START_TOKEN_ID, self.THINKING_END_TOKEN_ID)
            if start < 0 or len(ids) - start - 1 < budget:
                continue
            out = req.output_ids
            nl = self.NEW_LINE_TOKEN_ID
            token = self.THINKING_END_TOKEN_ID if out and out[-1] == nl else nl
            logits[row, :] = float("-inf")
            logits[row, token] = 0.0
        return logits


def _open_block(ids: list[int], start_id: int, end_id: int) -> int:
    """Index of the start token of a block still open at the end of ``ids``, or -1."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == end_id:
            return -1
        if ids[i] == start_id:
            return i
    return -1


class Glm4MoeThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 151350, 151351, 198


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 151667, 151668, 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 128798, 128799, 201


class InklingThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 200008, 200010, 198


class DeepseekOCRNoRepeatNGramLogitProcessor(CustomLogitProcessor):
    """Bans tokens that would repeat an n-gram (``ngram_size``) seen in the last
    ``window_size`` tokens of the prompt and output, except ``whitelist_token_ids``."""

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or []):
            if not params or params.get("__req__") is None:
                continue
            try:
                n = int(params.get("ngram_size") or 0)
                window = int(params.get("window_size") or 0)
                allowed = {int(t) for t in params.get("whitelist_token_ids") or []}
            except (TypeError, ValueError):
                continue
            req = params["__req__"]
            seq = [*req.origin_input_ids, *req.output_ids]
            if n <= 0 or window <= 0 or len(seq) < n:
                continue
            prefix = seq[len(seq) - n + 1 :] if n > 1 else []
            banned = {
                seq[i + n - 1]
                for i in range(max(0, len(seq) - window), len(seq) - n + 1)
                if seq[i : i + n - 1] == prefix
            } - allowed
            if banned:
                logits[row, sorted(banned)] = float("-inf")
        return logits


# What a payload may take from SGLang's module by name.
_EXPORTS = {
    c.__name__: c
    for c in (
        CustomLogitProcessor,
        DisallowedTokensLogitsProcessor,
        ThinkingBudgetLogitProcessor,
        Glm4MoeThinkingBudgetLogitProcessor,
        Qwen3ThinkingBudgetLogitProcessor,
        DeepSeekR1ThinkingBudgetLogitProcessor,
        InklingThinkingBudgetLogitProcessor,
        DeepseekOCRNoRepeatNGramLogitProcessor,
    )
}


class SGLangProcessor:
    """A payload's processor instance, called the way SGLang calls it."""

    def __init__(self, payload: str) -> None:
        try:
            import dill
        except ImportError as e:
            raise ValueError(
                "custom_logit_processor: serialised processors need the `dill` package "
                "(pip install 'loom[sglang]')"
            ) from e
        try:
            data = json.loads(payload)
            raw = bytes.fromhex(data["callable"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                'custom_logit_processor: not SGLang\'s {"callable": "<hex>"} payload '
                f"({type(e).__name__}: {e})"
            ) from None

        class Unpickler(dill.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                if module == SGLANG_MODULE:
                    if name not in _EXPORTS:
                        raise ValueError(f"{module}.{name} is not one Loom provides")
                    return _EXPORTS[name]
                return super().find_class(module, name)

        try:
            cls = Unpickler(io.BytesIO(raw)).load()
            self.processor = cls()  # SGLang instantiates what it unpickles
        except Exception as e:  # noqa: BLE001 - whatever the client's code raises
            raise ValueError(
                f"custom_logit_processor: cannot rebuild it ({type(e).__name__}: {e})"
            ) from None
        if not callable(self.processor):
            raise ValueError("custom_logit_processor: the payload's instance is not callable")
        self.name = type(self.processor).__name__

    def apply(self, logits: torch.Tensor, reqs: list[Any]) -> torch.Tensor:
        """``reqs``: the rows' requests (``rid``, ``origin_input_ids``, ``output_ids``,
        ``sampling_params``, ``is_finished``; ``processor_params`` is kept on them here)."""
        params = [_params_of(r) for r in reqs]
        return self.processor(logits, params)


def _params_of(req: Any) -> dict[str, Any] | None:
    """The request's ``custom_params`` with ``__req__``, one dict for the request's life."""
    d = getattr(req, "processor_params", None)
    if d is None:
        given = req.sampling_params.custom_params
        if given is None:
            return None
        d = req.processor_params = {**given, "__req__": ReqView(req)}
    return d


_cache: collections.OrderedDict[str, SGLangProcessor] = collections.OrderedDict()
_lock = threading.Lock()


def load(payload: str) -> SGLangProcessor:
    """The payload's processor, rebuilt once and kept while among the ``CACHE_SIZE`` most
    recently used; a ValueError says why a payload cannot be used."""
    with _lock:
        proc = _cache.get(payload)
        if proc is not None:
            _cache.move_to_end(payload)
            return proc
    proc = SGLangProcessor(payload)
    with _lock:
        _cache[payload] = proc
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return proc
