"""The schedule_policy family: the order in which waiting requests are admitted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.scheduler.request import Req


class SchedulePolicy(ABC):
    """Orders the waiting queue before admission.

    Contract: ``order`` returns a permutation of ``waiting`` (no request is dropped or duplicated)
    and may not mutate the requests. The scheduler admits in the returned order and stops at the
    first request that does not fit, so a policy decides who goes first, never who is lost.
    Retracted requests are put back at the front of the queue; stable policies keep them there.
    """

    @abstractmethod
    def order(self, waiting: list[Req]) -> list[Req]: ...


class FCFSPolicy(SchedulePolicy):
    """First come, first served (arrival order)."""

    def order(self, waiting: list[Req]) -> list[Req]:
        return list(waiting)
