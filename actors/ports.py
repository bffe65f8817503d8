"""What a part of the coordinator may do to the job: narrow ports instead of the coordinator.

A component holding the whole :class:`~actors.coordinator.Coordinator` can change anything, so
a reader has to read everything. A component holding :class:`JobPorts` can call methods on
ranks, ask for a job-wide sync, read the job's shared state (:class:`~actors.job.JobView`, read
only), the clock and the cluster's nodes, and record events; what it changed in the shared state
is an outcome (:data:`~actors.job.Outcome`) it returns or hands to ``apply``, and the loop
applies it (:func:`actors.job.apply_outcome`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from actors.job import JobView, Outcome
from raytrec.elastic.events import Event
from raytrec.elastic.rank_protocol import RankProtocol, ReformPlan
from raytrec.elastic.report import RankInfo, RankReport
from raytrec.elastic.workers import Clock, NodeInfo, RankCallError
from raytrec.sync.schedule import SyncPlan

__all__ = ["Booking", "JobPorts", "NewGeneration", "RankAnswers", "RankCalls"]

R = TypeVar("R")


class RankCalls(Protocol):
    """Calls one method on ``ranks`` (``invoke``, as in ``WorkerGroup.call``) and returns their
    answers in order; raises ``RankLost`` or ``RankFailed`` for the first rank whose call
    failed."""

    def __call__(
        self, ranks: list[int], invoke: Callable[[RankProtocol, int], R], /
    ) -> list[R]: ...


class RankAnswers(Protocol):
    """Like :class:`RankCalls`, but returns the answers of the ranks whose call returned, and
    the first error (a timeout before any other), instead of raising it."""

    def __call__(
        self, ranks: list[int], invoke: Callable[[RankProtocol, int], R], /
    ) -> tuple[dict[int, R], RankCallError | None]: ...


class Booking(Protocol):
    """Books ranks' reports; ``completed_through``: the syncs up to it completed everywhere."""

    def __call__(
        self, reports: list[RankReport], /, *, completed_through: int | None = None
    ) -> None: ...


class NewGeneration(Protocol):
    """Joins the live ranks to the membership's replica planes and sync plan (``reason``), in
    one call on each; ``before``: what a rank carries out first in that call (its replays)."""

    def __call__(self, reason: str, /, before: Mapping[int, ReformPlan] | None = None) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPorts:
    """The job as a component sees it (module doc)."""

    call: RankCalls
    #: The live ranks, sorted.
    live_ranks: Callable[[], list[int]]
    #: The live gang of a live rank.
    gang_of: Callable[[int], int]
    #: The job's step (where the last collected interval ended).
    step: Callable[[], int]
    #: A job-wide sync and its commit, unless the job synced at its step already.
    sync: Callable[[], None]
    #: Appends to the job's event log.
    record: Callable[[Event], None]
    #: Seconds since the job started, as events give them.
    now: Callable[[], float]
    clock: Clock
    #: The cluster's nodes, as the worker group sees them.
    cluster_nodes: Callable[[], Sequence[NodeInfo]]
    #: The job's shared state, read only.
    view: JobView
    #: Hands an outcome to the loop, which applies it to the shared state at once.
    apply: Callable[[Outcome], None]
    #: Calls on ranks that keep what came back when some did not.
    answers: RankAnswers
    #: Builds ranks (their node becomes known) and returns what each build returned.
    build: Callable[[list[int]], list[RankInfo]]
    new_generation: NewGeneration
    #: Books ranks' reports.
    account: Booking
    #: The live ranks, gang by gang.
    ranks_in_gang_order: Callable[[], list[int]]
    #: The clock's monotonic time as the event log's time.
    at: Callable[[float], float]
    #: The generation's sync schedule over the live gangs.
    sync_plan: Callable[[], SyncPlan]
