"""One interval's ``train`` calls on the live ranks and what came back of them: the values the
coordinator's loop, failure recovery (:mod:`actors.recovery`) and the node table
(:mod:`actors.nodes`) pass between them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from raytrec.elastic.report import RankReport
from raytrec.observability.metrics import CoordinatorTime

__all__ = ["Dispatched", "IntervalOutcome", "LoopTimer"]


@dataclasses.dataclass(frozen=True)
class Dispatched:
    """One interval's ``train`` calls, sent."""

    n: int  # steps
    end: int  # the step it ends at
    seq: int  # numbers the job's train calls (actors.rank.IntervalOrder)
    refs: dict[int, Any]  # job rank -> the future of its report
    t0: float  # perf_counter() where the interval's wall-clock time starts
    started: float  # monotonic() when sent: for the hang timeout


@dataclasses.dataclass
class IntervalOutcome:
    """The outcome of one interval call on every live rank."""

    reports: dict[int, RankReport] = dataclasses.field(default_factory=dict)
    dead: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> cause
    errored: dict[int, str] = dataclasses.field(default_factory=dict)
    hung: list[int] = dataclasses.field(default_factory=list)
    # Hung rank -> (the last step it finished, seconds it had been silent when found).
    silence: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)
    # Reports of intervals queued behind the failed one that some survivors went on to train.
    later: list[RankReport] = dataclasses.field(default_factory=list)
    # Seconds the coordinator sat blocked waiting for the reports (not working).
    waited_s: float = 0.0
    booked: bool = False  # recovery has booked the reports above
    # Deaths, node deaths and hangs already in the event log (a recovery started over).
    logged: set[int | str] = dataclasses.field(default_factory=set)
    # Dead rank -> when the coordinator learned it (its clock): the event log books the death
    # when the recovery starts, once every call of the interval has answered.
    noticed: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.dead or self.errored or self.hung)


class LoopTimer:
    """The coordinator loop's time from one history row to the next (:class:`CoordinatorTime`):
    wall-clock time between the ends it is given (``since``: where the first row's time starts,
    on the loop's ``perf_counter``), and its thread's CPU time by ``cpu``."""

    def __init__(self, *, since: float, cpu: Callable[[], float] = time.thread_time) -> None:
        self.cpu = cpu
        self.last, self.last_cpu = since, cpu()

    def lap(self, end: float, *, waited_s: float) -> CoordinatorTime:
        """The time up to ``end``, of which ``waited_s`` waiting for the ranks' reports; the
        next lap starts there."""
        cpu = self.cpu()
        out = CoordinatorTime(loop_s=end - self.last, waited_s=waited_s, cpu_s=cpu - self.last_cpu)
        self.last, self.last_cpu = end, cpu
        return out
