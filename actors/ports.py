"""What a part of the coordinator may do to the job: narrow ports instead of the coordinator.

A component holding the whole :class:`~actors.coordinator.Coordinator` can change anything, so
a reader has to read everything. The coordinator builds one :class:`JobPorts`: calls on ranks, a
job-wide sync, the job's shared state (:class:`~actors.job.JobView`, read only), the clock, the
cluster's nodes, the event log, and the loop's ``apply``. A component does not take it whole: its
constructor names a protocol of its own made of the ``Has...`` protocols below, one per port it
calls (``GrowthPorts`` in :mod:`actors.growth`, say), so mypy rejects a call of any other port and
a reader sees from the signature what the component can do. What it changed in the shared state
is an outcome (:data:`~actors.job.Outcome`) it returns or hands to ``apply``, and the loop applies
it (:func:`actors.job.apply_outcome`).
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

__all__ = [
    "Booking",
    "GenerationPorts",
    "HasAccount",
    "HasAnswers",
    "HasAt",
    "HasBuild",
    "HasCall",
    "HasClock",
    "HasClusterNodes",
    "HasEvents",
    "HasGangOf",
    "HasNewGeneration",
    "HasRankCalls",
    "HasRanksInGangOrder",
    "HasShared",
    "HasStep",
    "HasSync",
    "HasSyncPlan",
    "HasView",
    "JobPorts",
    "NewGeneration",
    "RankAnswers",
    "RankCalls",
]

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


class HasCall(Protocol):
    @property
    def call(self) -> RankCalls:
        """Calls one method on ranks (:class:`RankCalls`)."""


class HasView(Protocol):
    @property
    def view(self) -> JobView:
        """The job's shared state, read only."""


class HasRankCalls(HasCall, Protocol):
    @property
    def live_ranks(self) -> Callable[[], list[int]]:
        """The live ranks, sorted."""


class HasEvents(Protocol):
    @property
    def record(self) -> Callable[[Event], None]:
        """Appends to the job's event log."""

    @property
    def now(self) -> Callable[[], float]:
        """Seconds since the job started, as events give them."""


class HasShared(HasView, Protocol):
    @property
    def apply(self) -> Callable[[Outcome], None]:
        """Hands an outcome to the loop, which applies it to the shared state at once."""


class HasGangOf(Protocol):
    @property
    def gang_of(self) -> Callable[[int], int]:
        """The live gang of a live rank."""


class HasStep(Protocol):
    @property
    def step(self) -> Callable[[], int]:
        """The job's step (where the last collected interval ended)."""


class HasSync(Protocol):
    @property
    def sync(self) -> Callable[[], None]:
        """A job-wide sync and its commit, unless the job synced at its step already."""


class HasClock(Protocol):
    @property
    def clock(self) -> Clock:
        """The job's clock."""


class HasClusterNodes(Protocol):
    @property
    def cluster_nodes(self) -> Callable[[], Sequence[NodeInfo]]:
        """The cluster's nodes, as the worker group sees them."""


class HasAnswers(Protocol):
    @property
    def answers(self) -> RankAnswers:
        """Calls on ranks that keep what came back when some did not."""


class HasBuild(Protocol):
    @property
    def build(self) -> Callable[[list[int]], list[RankInfo]]:
        """Builds ranks (their node becomes known) and returns what each build returned."""


class HasNewGeneration(Protocol):
    @property
    def new_generation(self) -> NewGeneration:
        """Joins the live ranks to a new generation (:class:`NewGeneration`)."""


class HasAccount(Protocol):
    @property
    def account(self) -> Booking:
        """Books ranks' reports."""


class HasRanksInGangOrder(Protocol):
    @property
    def ranks_in_gang_order(self) -> Callable[[], list[int]]:
        """The live ranks, gang by gang."""


class HasAt(Protocol):
    @property
    def at(self) -> Callable[[float], float]:
        """The clock's monotonic time as the event log's time."""


class HasSyncPlan(Protocol):
    @property
    def sync_plan(self) -> Callable[[], SyncPlan]:
        """The generation's sync schedule over the live gangs."""


class GenerationPorts(
    HasRankCalls,
    HasStep,
    HasEvents,
    HasShared,
    HasNewGeneration,
    HasRanksInGangOrder,
    Protocol,
):
    """The ports of a part that changes the membership and forms a new generation: calls on
    the live ranks, the step, events, the shared record and ``apply``, a new generation, the
    ranks in gang order (:class:`~actors.growth.GangGrowth` and :class:`~actors.drain.GangDrain`
    call these; recovery and checkpoints more)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPorts:
    """Every port of the job, as the coordinator builds them (module doc; each field is
    described on its ``Has...`` protocol)."""

    call: RankCalls
    live_ranks: Callable[[], list[int]]
    gang_of: Callable[[int], int]
    step: Callable[[], int]
    sync: Callable[[], None]
    record: Callable[[Event], None]
    now: Callable[[], float]
    clock: Clock
    cluster_nodes: Callable[[], Sequence[NodeInfo]]
    view: JobView
    apply: Callable[[Outcome], None]
    answers: RankAnswers
    build: Callable[[list[int]], list[RankInfo]]
    new_generation: NewGeneration
    account: Booking
    ranks_in_gang_order: Callable[[], list[int]]
    at: Callable[[float], float]
    sync_plan: Callable[[], SyncPlan]
