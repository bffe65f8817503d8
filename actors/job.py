"""The job's shared state, owned by the coordinator's loop, and the outcomes that change it.

The parts of the job (drains, re-sharing, checkpoints, total loss, growth, placement, recovery)
each own their own state. What they share (the membership, the step, where the data ends, the
batch accounting, the gang cap, the rollback point, ...) is one :class:`JobRecord` that the loop
owns. A part reads it through :class:`JobView`, which has no setters (mypy rejects an assignment
through it), and never assigns to it: what it changed is an :data:`Outcome`, a frozen value it
returns or hands to the loop (its ``apply`` port, :class:`~actors.ports.HasShared`);
:func:`apply_outcome` is the one function that changes the record, and only the loop calls it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.decisions import RollbackPoint
from raytrec.elastic.membership import Gang, Membership

__all__ = [
    "AccountingRewound",
    "Booked",
    "CapChanged",
    "Committed",
    "DataEnds",
    "GangsDropped",
    "GangsJoined",
    "JobRecord",
    "JobView",
    "Joining",
    "Outcome",
    "PointSaved",
    "Prepared",
    "Rebuilding",
    "Rebuilt",
    "Regenerated",
    "Reserved",
    "Rewound",
    "apply_outcome",
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
    def accounting(self) -> BatchAccounting: ...
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
    """Ranks' reports were booked up to ``step``; ``synced_at``: the last job-wide sync among
    them, if one completed."""

    step: int
    synced_at: int | None = None


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
)


def apply_outcome(job: JobRecord, outcome: Outcome) -> None:
    """Changes ``job`` as ``outcome`` says: the only place the shared state changes."""
    m = job.membership
    match outcome:
        case AccountingRewound(accounting):
            job.accounting = accounting
        case Booked(step, synced_at):
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
