"""The job's shared state, owned by the coordinator's loop, and the outcomes that change it.

The parts of the job (drains, re-sharing, checkpoints, total loss, growth, placement, recovery)
each own their own state. What they share (the membership, the step, where the data ends, the
batch accounting, the gang cap, the rollback point, ...) is one :class:`JobRecord` that the loop
owns. A part reads it through :class:`JobView`, which has no setters (mypy rejects an assignment
through it), and never assigns to it: what it changed is an :data:`Outcome`, a frozen value it
returns or hands to the loop (its ``apply`` port, :class:`~actors.ports.HasShared`);
:func:`apply_outcome` is the one function that changes the record, and only the loop calls
it. The batch accounting too: a part reads it as an
:class:`~raytrec.elastic.accounting.AccountingView` (queries only, so mypy rejects a call that
changes it), computes with those queries what a change does (the reports of lost ranks, where
dropped gangs' batches go), and hands that to the loop as an outcome.

It also holds the values one interval's ``train`` calls pass between the loop, failure recovery
(:mod:`actors.recovery`) and the node table (:mod:`actors.nodes`): :class:`Dispatched` and
:class:`IntervalOutcome`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol, assert_never

from raytrec.elastic.accounting import AccountingView, BatchAccounting, DropPlan
from raytrec.elastic.decisions import RollbackPoint
from raytrec.elastic.membership import Gang, Membership
from raytrec.elastic.report import RankReport
from raytrec.elastic.rollback import StreamStart

__all__ = [
    "AccountingOutcome",
    "AccountingRewound",
    "Booked",
    "CapChanged",
    "Committed",
    "DataEnds",
    "Dispatched",
    "GangsAccounted",
    "GangsDropped",
    "GangsDroppedFromBooks",
    "GangsJoined",
    "IntervalOutcome",
    "JobRecord",
    "JobView",
    "Joining",
    "Outcome",
    "PointSaved",
    "Prepared",
    "RanksAdded",
    "RanksForgotten",
    "RanksLost",
    "Rebuilding",
    "Rebuilt",
    "Regenerated",
    "Reserved",
    "Rewound",
    "StreamSwitched",
    "StreamsContinued",
    "StreamsRestarted",
    "StreamsRetired",
    "apply_outcome",
    "apply_to_accounting",
]


@dataclasses.dataclass
class JobRecord:
    """The state the job's parts share (module doc)."""

    membership: Membership
    step: int  # where the last collected interval ended
    # The step the job's data ends at: num_steps, or for a re-shared source the end of its rows.
    end_step: int
    max_gangs: int
    accounting: BatchAccounting
    last_save: tuple[int, float]  # (step, clock) of the last save (or start, or rebuild)
    ready: int = 0  # batches every live rank holds prepared beyond the job's step
    point: RollbackPoint | None = None  # what a total loss goes back to
    joining: frozenset[int] = frozenset()  # gangs added to the membership but not healed yet


class JobView(Protocol):
    """:class:`JobRecord`, read only."""

    @property
    def membership(self) -> Membership: ...
    @property
    def step(self) -> int: ...
    @property
    def end_step(self) -> int: ...
    @property
    def max_gangs(self) -> int: ...
    @property
    def accounting(self) -> AccountingView: ...
    @property
    def last_save(self) -> tuple[int, float]: ...
    @property
    def ready(self) -> int: ...
    @property
    def point(self) -> RollbackPoint | None: ...
    @property
    def joining(self) -> frozenset[int]: ...


@dataclasses.dataclass(frozen=True)
class Committed:
    """A job-wide sync completed at the job's step: everything trained is in every replica."""


@dataclasses.dataclass(frozen=True)
class AccountingRewound:
    """The batch accounting, back at a checkpoint's."""

    accounting: BatchAccounting


@dataclasses.dataclass(frozen=True)
class Booked:
    """Ranks' ``reports`` are booked up to ``step``; ``synced_at``: the last job-wide sync among
    them, if one completed (:func:`~raytrec.elastic.accounting.last_job_wide_sync`)."""

    step: int
    synced_at: int | None = None
    reports: tuple[RankReport, ...] = ()


# -- the batch accounting's books (raytrec.elastic.accounting) ---------------------------------


@dataclasses.dataclass(frozen=True)
class RanksAdded:
    """Ranks (job rank -> the stream it reads) are booked as training from job step ``step``."""

    shards: Mapping[int, int]
    step: int


@dataclasses.dataclass(frozen=True)
class RanksForgotten:
    """Ranks that trained nothing (they failed while starting) leave the books."""

    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RanksLost:
    """Ranks died or left having trained what their ``reports`` say
    (:meth:`~raytrec.elastic.accounting.BatchAccounting.reports_of_lost`): they leave the books,
    their streams retired after those batches."""

    reports: tuple[RankReport, ...]


@dataclasses.dataclass(frozen=True)
class GangsAccounted:
    """Gangs that joined are booked, with nothing pending and nothing to replay."""

    gangs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GangsDroppedFromBooks:
    """Gangs leave the books; their uncommitted batches go to the survivors as ``plan`` says
    (:meth:`~raytrec.elastic.accounting.BatchAccounting.plan_drop`)."""

    plan: DropPlan


@dataclasses.dataclass(frozen=True)
class StreamsRestarted:
    """The ranks' streams restart at batch ``at`` (a resume from a checkpoint)."""

    ranks: tuple[int, ...]
    at: int


@dataclasses.dataclass(frozen=True)
class StreamsContinued:
    """Ranks booked with :class:`RanksAdded` train from job step ``step`` on, each reading
    its ``starts`` (a checkpoint's streams continued); ``gangs``: job rank -> its gang."""

    starts: Mapping[int, StreamStart]
    gangs: Mapping[int, int]
    step: int


@dataclasses.dataclass(frozen=True)
class StreamSwitched:
    """The rank reads stream ``shard`` from its start, after its queued replays; its old
    stream is retired at ``old_ends_at``."""

    rank: int
    shard: int
    old_ends_at: int


@dataclasses.dataclass(frozen=True)
class StreamsRetired:
    """Streams no rank continues, stopped where ``positions`` (stream -> next batch) say."""

    positions: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class GangsDropped:
    """These gangs left the membership (lost, drained, or not healed)."""

    gangs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GangsJoined:
    """These gangs (built, with their nodes) joined at the job's step."""

    gangs: tuple[Gang, ...]


@dataclasses.dataclass(frozen=True)
class Reserved:
    """Slots reserved for gangs being built (:meth:`Membership.reserve`): the membership
    after it."""

    membership: Membership


@dataclasses.dataclass(frozen=True)
class Regenerated:
    """The job re-formed with the same gangs: a new generation."""


@dataclasses.dataclass(frozen=True)
class Joining:
    """The gangs added but not healed yet."""

    gangs: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Rewound:
    """The job went back to a checkpoint's ``step``; ``synced``: its state is the one the
    checkpoint saved after a job-wide sync."""

    step: int
    synced: bool = False


@dataclasses.dataclass(frozen=True)
class DataEnds:
    """Where the job's data now ends (a re-share, or replays that go beyond it)."""

    end_step: int


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Batches every live rank now holds prepared beyond the job's step."""

    ready: int


@dataclasses.dataclass(frozen=True)
class CapChanged:
    """The most gangs the job may have (a drain lowers it)."""

    max_gangs: int


@dataclasses.dataclass(frozen=True)
class PointSaved:
    """A checkpoint saved or resumed from: what a total loss goes back to, and the last save
    (``at``: the clock's monotonic time)."""

    point: RollbackPoint
    at: float


@dataclasses.dataclass(frozen=True)
class Rebuilding:
    """A total loss is being recovered from ``point`` (its count of restores raised)."""

    point: RollbackPoint


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    """The job was rebuilt from the checkpoint of ``step``; ``at``: when (the last save's
    time, for the checkpoint rules)."""

    step: int
    at: float


#: The outcomes that change only the batch accounting (:func:`apply_to_accounting`).
AccountingOutcome = (
    RanksAdded
    | RanksForgotten
    | RanksLost
    | GangsAccounted
    | GangsDroppedFromBooks
    | StreamsRestarted
    | StreamsContinued
    | StreamSwitched
    | StreamsRetired
)

Outcome = (
    AccountingRewound
    | Booked
    | Committed
    | GangsDropped
    | GangsJoined
    | Reserved
    | Regenerated
    | Joining
    | Rewound
    | DataEnds
    | Prepared
    | CapChanged
    | PointSaved
    | Rebuilding
    | Rebuilt
    | AccountingOutcome
)


def _gang_of(m: Membership) -> Callable[[int], int]:
    def gang_of(rank: int) -> int:
        gang = m.gang_of_rank(rank)
        assert gang is not None, f"rank {rank} is in no live gang"
        return gang

    return gang_of


def apply_outcome(job: JobRecord, outcome: Outcome) -> None:
    """Changes ``job`` as ``outcome`` says: the only place the shared state changes."""
    m = job.membership
    match outcome:
        case AccountingRewound(accounting):
            job.accounting = accounting
        case Booked(step, synced_at, reports):
            job.accounting.book(
                reports, gang_of=_gang_of(m), live_gangs=m.gang_ids, synced_at=synced_at
            )
            if synced_at is not None:
                job.membership = m.synced(synced_at)
            job.step = step
        case Committed():
            job.accounting.commit(m.gang_ids)
            job.membership = m.synced(job.step)
        case GangsDropped(gangs):
            job.membership = m.without(gangs)
            job.joining = job.joining - set(gangs)
        case GangsJoined(gangs):
            job.membership = m.with_gangs(gangs, step=job.step)
        case Reserved(membership):
            job.membership = membership
        case Regenerated():
            job.membership = dataclasses.replace(m, generation=m.generation + 1)
        case Joining(gangs):
            job.joining = gangs
        case Rewound(step, synced):
            job.step = step
            if synced:
                job.membership = m.synced(step)
        case DataEnds(end_step):
            job.end_step = end_step
        case Prepared(ready):
            job.ready = ready
        case CapChanged(max_gangs):
            job.max_gangs = max_gangs
        case PointSaved(point, at):
            job.point = point
            job.last_save = (point.step, at)
        case Rebuilding(point):
            job.point = point
        case Rebuilt(step, at):
            job.last_save = (step, at)
        case (
            RanksAdded()
            | RanksForgotten()
            | RanksLost()
            | GangsAccounted()
            | GangsDroppedFromBooks()
            | StreamsRestarted()
            | StreamsContinued()
            | StreamSwitched()
            | StreamsRetired()
        ):
            apply_to_accounting(job.accounting, outcome)
        case _:
            assert_never(outcome)


def apply_to_accounting(acc: BatchAccounting, outcome: AccountingOutcome) -> None:
    """Changes the batch accounting as ``outcome`` says (part of :func:`apply_outcome`)."""
    match outcome:
        case RanksAdded(shards, step):
            for rank, shard in shards.items():
                acc.add_rank(rank, shard=shard, step=step)
        case RanksForgotten(ranks):
            for rank in ranks:
                acc.forget_rank(rank)
        case RanksLost(reports):
            acc.lose_ranks(reports)
        case GangsAccounted(gangs):
            acc.add_gangs(gangs)
        case GangsDroppedFromBooks(plan):
            acc.apply_drop(plan)
        case StreamsRestarted(ranks, at):
            for rank in ranks:
                acc.restart(rank, at=at)
        case StreamsContinued(starts, gangs, step):
            for rank, s in starts.items():
                acc.resume_rank(rank, gang=gangs[rank], step=step, stream_at=s.at, replay=s.replay)
        case StreamSwitched(rank, shard, old_ends_at):
            acc.switch_stream(rank, shard=shard, old_ends_at=old_ends_at)
        case StreamsRetired(positions):
            acc.retire_streams(positions)
        case _:
            assert_never(outcome)


# -- one interval's train calls and what came back (the loop, recovery and the node table) --


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
