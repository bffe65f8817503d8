"""What happened to the job's membership, as values with a time and a step.

Every failure noticed, gang dropped or added, generation started, wait for resources and final
failure is one :class:`Event`. They go into an append-only :class:`EventLog`, which the
coordinator returns with the run's result (``Result.events``): read it by type,
``result.events.of(GangJoined)``, or in order, each event with its ``kind``, ``at``, ``step`` and
fields. JSON only where the events leave the process (``events.jsonl``, ``summary.json``):
``to_dict()`` and ``to_dicts()``. ``at`` is the injected clock's time in seconds, ``step`` the
job's completed steps when it happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar, overload

__all__ = [
    "CheckpointRestored",
    "CheckpointSaved",
    "CoordinatorLost",
    "CoordinatorRestarted",
    "DataGrowthEnded",
    "DataReshared",
    "DomainShared",
    "DrainRejected",
    "EarlyStopped",
    "Event",
    "EventLog",
    "FailedStepSettled",
    "FilesLanded",
    "GangDrained",
    "GangDropped",
    "GangHealed",
    "GangJoined",
    "GangPlaced",
    "GangRequested",
    "GenerationStarted",
    "HangDetected",
    "HealFailed",
    "JobFailed",
    "ModelPublished",
    "NodeDied",
    "PlacementWaiting",
    "RankDied",
    "ResourcesWaited",
    "StragglerEvicted",
    "TotalLoss",
]


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str] = "event"
    at: float
    step: int

    def to_dict(self) -> dict[str, Any]:
        """``{"kind": ..., "at": ..., "step": ..., <fields>}`` with tuples as lists."""
        fields = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"kind": self.kind, **fields}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankDied(Event):
    """A rank died; ``at`` is when the recovery started, ``noticed_at`` (when known) when the
    coordinator learned of the death, earlier by however long the interval's other calls
    took to answer."""

    kind: ClassVar[str] = "rank_died"
    job_rank: int
    gang_id: int | None
    cause: str = ""
    node: str = ""  # the node it ran on: "<node id> at <address>"
    noticed_at: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeDied(Event):
    kind: ClassVar[str] = "node_died"
    node: int  # the job's index of the node (in order of first sight)
    gang_ids: tuple[int, ...]
    node_id: str = ""  # Ray's node id
    address: str = ""  # the node's Ray address


@dataclasses.dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    kind: ClassVar[str] = "hang_detected"
    job_ranks: tuple[int, ...]
    gang_ids: tuple[int, ...]
    #: The step the hung ranks last finished, and for how long they had been silent.
    last_step: int
    silent_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangDropped(Event):
    kind: ClassVar[str] = "gang_dropped"
    gang_id: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailedStepSettled(Event):
    """After a re-forming: the dense state the job went on from (``step`` is the failed one)."""

    kind: ClassVar[str] = "failed_step_settled"
    #: The last step whose dense update that state holds; the lost gangs' batches trained at or
    #: before it are replayed for their embedding rows only.
    dense_through: int
    dense_from: int  # the job rank whose dense state every rank took
    finished: bool  # the survivors applied the failed step's dense update among themselves
    embedding_only: int  # replay batches handed out that update embedding rows only
    #: Under ``sync.levels``: the surviving gangs that had averaged with a lost gang at a lower
    #: level since the last job-wide sync; they took the other survivors' mean, and their
    #: batches since that sync were replayed (:mod:`raytrec.elastic.group_rollback`).
    rolled_back: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationStarted(Event):
    kind: ClassVar[str] = "generation_started"
    generation: int
    gang_ids: tuple[int, ...]
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangRequested(Event):
    kind: ClassVar[str] = "gang_requested"
    #: Placement groups requested now, and how many are outstanding after this request.
    count: int
    outstanding: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangPlaced(Event):
    kind: ClassVar[str] = "gang_placed"
    #: The node of each gang rank ("<node id> at <address>"), in gang-rank order.
    nodes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DomainShared(Event):
    """Gang ``gang_id`` was placed in a failure domain (``scaling.failure_domain``) that other
    gangs of the job hold too, because no domain of its own had room: one loss there takes
    all of them (a total loss when they are every gang)."""

    kind: ClassVar[str] = "domain_shared"
    gang_id: int
    domain: str  # "node <node id> at <address>", or "<label>=<value>"
    with_gangs: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangHealed(Event):
    kind: ClassVar[str] = "gang_healed"
    gang_id: int
    peer_gang_id: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangDrained(Event):
    """A gang given back on purpose at an interval boundary, its work committed first."""

    kind: ClassVar[str] = "gang_drained"
    gang_id: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StragglerEvicted(Event):
    """A gang evicted as a persistent straggler (``elastic.straggler_eviction``): its step time
    ``step_s`` against the other gangs' median ``others_s`` for ``intervals`` intervals in a
    row. It is drained (a ``gang_drained`` follows) and a replacement asked for."""

    kind: ClassVar[str] = "straggler_evicted"
    gang_id: int
    step_s: float
    others_s: float
    intervals: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrainRejected(Event):
    """A drain request that could not be read or asked for something not allowed."""

    kind: ClassVar[str] = "drain_rejected"
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealFailed(Event):
    """A gang's state after healing differs from the peer it copied (digests compared before
    any averaging): it is dropped and placed again."""

    kind: ClassVar[str] = "heal_failed"
    gang_id: int
    peer_gang_id: int
    job_ranks: tuple[int, ...]  # ranks whose digest differs from their peer's


@dataclasses.dataclass(frozen=True, kw_only=True)
class GangJoined(Event):
    kind: ClassVar[str] = "gang_joined"
    gang_id: int
    generation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataReshared(Event):
    """The rows no rank had trained yet were cut again among the live ranks (after a gang was
    lost or joined): every rank now has ``batches`` more to train (``queued`` of them replays of
    a lost gang's uncommitted batches), so the job's data ends at ``end_step``. ``left_over``:
    rows of an epoch too few to give every rank a batch (not trained). ``handed_off``: a join
    where the live ranks kept reading their streams, cut short, and the ``ranks`` joining ranks
    were given the ``rows`` of their ends. ``taken_over``: a loss where the ``ranks`` survivors
    read on to the end of their streams' current parts, and the lost ranks' ``rows`` left and
    the survivors' rows after those parts were dealt out and appended to their streams."""

    kind: ClassVar[str] = "data_reshared"
    ranks: int
    rows: int
    batches: int
    end_step: int
    left_over: int = 0
    handed_off: bool = False
    taken_over: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilesLanded(Event):
    """New files of a growing source (``data.growing``) were found, and their ``rows`` shared
    among the live ranks with the rows left: the job's data now ends at ``end_step``, and step
    ``first_step`` is the first to train some of their rows (None: a rank was lost while they
    were shared, and the recovery shared them again). ``landed_at``: each file's modification
    time (seconds since the epoch), ``found_at`` the wall-clock time each was listed."""

    kind: ClassVar[str] = "files_landed"
    paths: tuple[str, ...]
    rows: int
    end_step: int
    first_step: int | None
    landed_at: tuple[float, ...]
    found_at: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataGrowthEnded(Event):
    """A growing source's job ended after training every row of its ``files`` files (``reason``:
    ``data.growing.max_files`` reached, or no new file for ``data.growing.idle_stop_s``)."""

    kind: ClassVar[str] = "data_growth_ended"
    files: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourcesWaited(Event):
    kind: ClassVar[str] = "resources_waited"
    live_gangs: int
    min_gangs: int
    deadline: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementWaiting(Event):
    """The job's placement groups are not ready yet (repeated while it waits)."""

    kind: ClassVar[str] = "placement_waiting"
    waited_s: float
    wait_s: float  # elastic.resource_wait_s: when the job gives up
    asked: str  # the bundles, e.g. "2 x {CPU: 2} (a gang's ranks on one node)"
    nodes: str  # the cluster's live nodes


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFailed(Event):
    kind: ClassVar[str] = "job_failed"
    reason: str
    #: True when no live copy of some shard is left, so only a checkpoint can recover the job.
    needs_checkpoint: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class TotalLoss(Event):
    """Some shard lost every live copy; the job is rebuilt from the checkpoint ``uri``."""

    kind: ClassVar[str] = "total_loss"
    lost_gangs: tuple[int, ...]
    #: Replica groups (shard positions) whose every copy was on a lost rank.
    dead_shards: tuple[int, ...]
    uri: str
    checkpoint_step: int
    #: Completed steps after the checkpoint, trained again (the interval that was running when
    #: the loss hit is trained again too).
    steps_to_redo: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSaved(Event):
    kind: ClassVar[str] = "checkpoint_saved"
    uri: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPublished(Event):
    """The model published for serving (``publish``): the base export (``delta`` 0) or a
    delta of ``rows`` table rows. ``stall_s``: what training waited for (the sync, copying the
    rows out, handing them to the writer), not the write, which goes on meanwhile."""

    kind: ClassVar[str] = "model_published"
    delta: int
    rows: int
    stall_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRestored(Event):
    kind: ClassVar[str] = "checkpoint_restored"
    uri: str
    #: The saved job's step and generation.
    saved_step: int
    saved_generation: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlyStopped(Event):
    """Held-out evaluation stopped improving (``eval.early_stopping_patience``): the job ends
    at this boundary."""

    kind: ClassVar[str] = "early_stopped"
    metric: str
    best: float
    best_step: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorLost(Event):
    """The coordinator's process died (``attempt``: which coordinator of the run, 0 the
    first); ``step``: the job's step at its last journal record."""

    kind: ClassVar[str] = "coordinator_lost"
    attempt: int
    reason: str
    #: Restarts still allowed (elastic.max_coordinator_restarts less those done).
    restarts_left: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class CoordinatorRestarted(Event):
    """A new coordinator continues the run from checkpoint ``uri`` of ``checkpoint_step``
    (None: from the start of the data, with a fresh model); the ranks, owned by the lost
    coordinator, died with it and are placed again."""

    kind: ClassVar[str] = "coordinator_restarted"
    attempt: int
    uri: str | None
    checkpoint_step: int
    #: Batches committed after the checkpoint, which the new coordinator trains (and commits)
    #: again; each is counted once in the run's ledger.
    rolled_back_batches: int


E = TypeVar("E", bound=Event)


class EventLog(Sequence[Event]):
    """Append-only, time-ordered events: iterated, indexed and sliced as :class:`Event` values,
    and read by type with :meth:`of`. Equal to another log holding the same events."""

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._events: list[Event] = []
        self.append(*events)

    def append(self, *events: Event) -> None:
        for e in events:
            if self._events and e.at < self._events[-1].at:
                raise ValueError(
                    f"event {e.kind} at t={e.at} is earlier than the last one "
                    f"({self._events[-1].kind} at t={self._events[-1].at}); the log is time-ordered"
                )
            self._events.append(e)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(tuple(self._events))

    @overload
    def __getitem__(self, index: int) -> Event: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Event, ...]: ...

    def __getitem__(self, index: int | slice) -> Event | tuple[Event, ...]:
        if isinstance(index, slice):
            return tuple(self._events[index])
        return self._events[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EventLog):
            return NotImplemented
        return self._events == other._events

    __hash__ = None  # type: ignore[assignment]  # appended to: not hashable

    def __repr__(self) -> str:
        return f"EventLog({self._events!r})"

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    def of(self, kind: type[E]) -> tuple[E, ...]:
        """The events of one type, in order."""
        return tuple(e for e in self._events if isinstance(e, kind))

    def kinds(self) -> list[str]:
        return [e.kind for e in self._events]

    def to_dicts(self) -> list[dict[str, Any]]:
        """Every event's :meth:`Event.to_dict`, in order (JSON-ready)."""
        return [e.to_dict() for e in self._events]
