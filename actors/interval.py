"""One interval's ``train`` calls on the live ranks and what came back of them: the values the
coordinator's loop, failure recovery (:mod:`actors.recovery`) and the node table
(:mod:`actors.nodes`) pass between them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrec.elastic.report import RankReport

__all__ = ["Dispatched", "IntervalOutcome"]


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
    booked: bool = False  # recovery has booked the reports above
    # Deaths, node deaths and hangs already in the event log (a recovery started over).
    logged: set[int | str] = dataclasses.field(default_factory=set)
    # Dead rank -> when the coordinator learned it (its clock): the event log books the death
    # when the recovery starts, once every call of the interval has answered.
    noticed: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.dead or self.errored or self.hung)
