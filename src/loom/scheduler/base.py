"""The interface of the ``schedule_policy`` family (``SchedulePolicy``) and the read-only view of
the prefix cache a policy gets (``PrefixView``; ``NoPrefixCache`` when the cache is off).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from loom.scheduler.request import Req


class PrefixView(Protocol):
    """What a policy may ask the prefix cache, without changing it."""

    def match(self, req: Req) -> tuple[int, Any]:
        """(cached prefix length of the request's tokens, the deepest fully matched tree node;
        None when nothing matches). Nodes have ``parent`` and ``children`` attributes."""


class NoPrefixCache:
    """The view when the radix cache is disabled: nothing is ever cached."""

    def match(self, req: Req) -> tuple[int, Any]:
        return 0, None


class SchedulePolicy(ABC):
    """Orders the waiting queue before admission.

    Contract: ``order`` returns a permutation of ``waiting`` (no request is dropped or duplicated)
    and may not mutate the requests or the cache. The scheduler admits in the returned order and
    stops at the first request that does not fit, so a policy decides who goes first, never who
    is lost. Retracted requests are put back at the front of the queue; stable policies keep them
    there. Constructor keyword options are server flags (e.g. ``seed``); ignore unknown ones.
    """

    # Whether ``order`` is a function of the queue and the cache (two calls agree). The
    # scheduler then checks only the first request's fit to decide whether a decode step may
    # chain while requests wait; otherwise it checks a lower bound over the whole queue.
    deterministic = True

    def __init__(self, **options: Any) -> None:
        self.options = options

    @abstractmethod
    def order(self, waiting: list[Req], cache: PrefixView) -> list[Req]: ...
