"""The states of the coordinator's loop (:mod:`actors.job_loop`), one class each.

The loop runs ``while not state.is_terminal(): state = self.step(state)``, as Ray Train v2's
controller does; each step carries out what its state stands for and returns the next one:

- :class:`Starting`: host the store and ask for every gang's placement; then :class:`Placing`.
- :class:`Placing`: wait for a whole job's placement groups as ``decide`` says, start its ranks;
  then :class:`Forming` (or :class:`Preparing` once a resumed job loaded its checkpoint), or the
  rest of a rebuild.
- :class:`Forming`: build the ranks, form the first generation, copy gang 0's state to all.
- :class:`Preparing`: the ranks read the first interval's batches.
- :class:`Running`: at a boundary, decide (stop, drain, join, wait) and send an interval; collect
  it, book it; then :class:`AtBoundary`.
- :class:`AtBoundary`: after an interval: an evaluation, early stopping, a checkpoint.
- :class:`Waiting`: too few gangs: wait for placements, as ``decide`` says.
- :class:`Recovering`: ranks were lost (``cause``): drop their gangs and re-form among the
  survivors; then ``then``, the state that was cut short. A rank call that fails anywhere
  returns this state to the loop; a loss while re-forming returns it again, with both causes.
- :class:`Rebuilding`: a total loss: the whole job rebuilt from a checkpoint (its placement
  through :class:`Placing`); then ``then``.
- :class:`Finishing`: the final sync, the replica check, the final model.
- :class:`Done` (the run's summary) and :class:`Failed` (a :class:`~raytrec.elastic.decisions.Fail`
  decided, or losses beyond the loop's bounds: ``run`` raises its ``error``): terminal.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Union

from actors.gang_placement import PendingJob
from actors.job import Dispatched, IntervalOutcome
from actors.total_loss import PendingRebuild
from raytrec.elastic.decisions import TotalLoss
from raytrec.elastic.report import RankReport
from raytrec.elastic.rollback import StreamStart
from raytrec.elastic.run_record import RunSummary

__all__ = [
    "AtBoundary",
    "Done",
    "Failed",
    "Finishing",
    "Forming",
    "JobLoopState",
    "Placing",
    "Preparing",
    "Rebuilding",
    "Recovering",
    "Running",
    "Starting",
    "Waiting",
]


class _State:
    def is_terminal(self) -> bool:
        return False


@dataclasses.dataclass
class Starting(_State):
    """``placed``: every gang's ranks started, each reading from ``starts`` (a resume)."""

    placed: bool = False
    starts: dict[int, StreamStart] | None = None


@dataclasses.dataclass
class Forming(_State):
    attempts_left: int  # losses while the job starts, before it gives up


@dataclasses.dataclass
class Preparing(_State):
    pass


@dataclasses.dataclass
class Running(_State):
    """Training interval by interval. ``prepared``: the live ranks hold the next interval's
    batches already (else nothing counts as prepared as it starts: after a recovery);
    ``entering``: that is still to be applied."""

    prepared: bool = False
    entering: bool = True
    inflight: deque[Dispatched] = dataclasses.field(default_factory=deque)  # sent, in order
    stop: BaseException | None = None  # a rank could not prepare all it was asked to
    t0: float = 0.0  # where the next interval's wall-clock time starts
    waited: bool = False  # back from :class:`Waiting`: the boundary's first half is done
    finishing: int = 0  # finishing attempts before this (training again after a loss)


@dataclasses.dataclass
class AtBoundary(_State):
    """An interval was collected and booked: what comes after it at this boundary."""

    running: Running
    reports: list[RankReport]
    wall_s: float
    end: float  # perf_counter() at the boundary
    waited_s: float = 0.0  # of the coordinator's time since the last row, waiting for reports
    evaluated: bool = False  # the evaluation due here ran (or was cut short by a loss)
    recovered: bool = False  # a loss during the evaluation was recovered from


@dataclasses.dataclass
class Waiting(_State):
    """Below ``elastic.min_gangs``: waiting for gangs since ``since``; then ``running``."""

    since: float
    running: Running


@dataclasses.dataclass
class Recovering(_State):
    cause: IntervalOutcome
    then: JobLoopState
    attempts_left: int  # further losses while re-forming, before the job gives up


@dataclasses.dataclass
class Rebuilding(_State):
    decision: TotalLoss
    then: JobLoopState
    attempt: int = 0
    error: str = ""  # why the last attempt failed
    placed: PendingRebuild | None = None  # its ranks started: load the checkpoint


@dataclasses.dataclass
class Placing(_State):
    """A whole job's placement groups asked for (at the start, or for a rebuild:
    ``rebuilding``); once they are ready its ranks start, then ``then``."""

    job: PendingJob
    then: JobLoopState
    rebuilding: Rebuilding | None = None


@dataclasses.dataclass
class Finishing(_State):
    """Training ended (``stopped_by``: why early, or None); ``attempt``: finishes cut short by
    a loss so far; ``resume``: after such a loss, train on if steps are left."""

    stopped_by: BaseException | None
    attempt: int = 0
    resume: bool = False


@dataclasses.dataclass
class Done(_State):
    summary: RunSummary

    def is_terminal(self) -> bool:
        return True


@dataclasses.dataclass
class Failed(_State):
    error: BaseException

    def is_terminal(self) -> bool:
        return True


JobLoopState = Union[  # noqa: UP007 (a forward reference)
    Starting,
    Forming,
    Preparing,
    Running,
    AtBoundary,
    Waiting,
    Placing,
    Recovering,
    Rebuilding,
    Finishing,
    Done,
    Failed,
]
