"""What a test scripts for the fake worker group: its fault schedule, its clock and its shards.

:class:`~simulation.doubles.fake_group.FakeWorkerGroup` carries out the schedule: a rank or node
that dies (:class:`RankDies`, :class:`NodeDies`), hangs (:class:`RankHangs`), fails once
(:class:`RankFails`) or is slow (:class:`SlowRank`); a node marked draining
(:class:`NodeDrains`); a heal that goes wrong (:class:`HealCorrupted`); nodes that join later
(:class:`NodesJoin`); and anything else once a step is done (:class:`AtStep`, e.g. a user's
drain request) or as a call is made (:class:`AtCall`). :class:`ManualClock` moves only when
the coordinator sleeps or waits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from raytrec.data.source import BatchShard

if TYPE_CHECKING:
    from collections.abc import Iterator

    from raytrec.data.source import Batch

__all__ = [
    "AtCall",
    "AtStep",
    "CallFault",
    "FakeShard",
    "Fault",
    "GroupBreaks",
    "HealCorrupted",
    "ManualClock",
    "NodeDies",
    "NodeDrains",
    "NodesJoin",
    "RankDies",
    "RankFails",
    "RankHangs",
    "SlowRank",
]


# -- the fault schedule -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankDies:
    """Job rank ``rank`` dies as it starts job step ``step``, or at its ``nth`` ``on`` call (a
    :class:`~actors.rank.RankWorker` method name, e.g. ``"recover"`` or ``"build"``)."""

    rank: int
    step: int | None = None
    on: str | None = None
    nth: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupBreaks:
    """Rank ``rank``'s ``nth`` ``on`` call (a collective, e.g. ``"broadcast_dense"``) fails on
    every rank taking part, as a gloo pair closed after a timeout does; every rank lives."""

    rank: int
    on: str
    nth: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeDies:
    """Fake node ``node`` (its index) leaves the cluster as job step ``step`` starts."""

    node: int
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankHangs:
    """Rank ``rank`` (None: every rank) finishes step ``step - 1`` and never another; or, with
    ``on``, its ``nth`` ``on`` call never returns (a control call stuck in a collective)."""

    step: int | None = None
    rank: int | None = None
    on: str | None = None
    nth: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFails:
    """Rank ``rank`` raises ``after_s`` into step ``step`` (a collective gave up) and stays
    alive: a transient failure."""

    rank: int
    step: int
    after_s: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlowRank:
    """Rank ``rank`` takes ``step_s`` seconds a step (and so does every rank, in lockstep: the
    faster ones report the wait as their sync time)."""

    rank: int
    step_s: float
    #: From this step on it is as fast as the others (None: slow for good); a train call that
    #: starts before it is slow throughout.
    until_step: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeDrains:
    """The cluster marks fake node ``node`` for removal once job step ``step`` is done."""

    node: int
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealCorrupted:
    """Rank ``rank``'s state is off by one weight after its first ``broadcast_state``."""

    rank: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class AtStep:
    """Calls ``action`` once job step ``step`` is done (a user asking for a drain, say)."""

    step: int
    action: Callable[[], object]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AtCall:
    """Calls ``action`` as rank ``rank``'s ``nth`` ``on`` call is made (a user asking for a
    drain or a stop while the job is in that call)."""

    rank: int
    on: str
    action: Callable[[], object]
    nth: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodesJoin:
    """``count`` nodes join the cluster at clock time ``at``."""

    at: float
    count: int = 1


Fault = (
    RankDies
    | GroupBreaks
    | NodeDies
    | RankHangs
    | RankFails
    | SlowRank
    | NodeDrains
    | HealCorrupted
    | AtStep
    | AtCall
)

#: The faults that fire at a rank's call rather than at a step.
CallFault = RankDies | GroupBreaks | RankHangs | AtCall


# -- the clock --------------------------------------------------------------------------------


class ManualClock:
    """A clock that moves only when it is told to: by ``sleep``, or by the fake group while the
    coordinator waits. ``monotonic`` and ``perf_counter`` read the same time."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._listeners: list[Callable[[], None]] = []

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.advance_to(self.now + max(0.0, seconds))

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t
            for listener in self._listeners:
                listener()

    def on_advance(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)


# -- data -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeShard(BatchShard):
    """A shard a fake rank reads by batch id only: batch ``k`` is ``batch_id(index, k)``, the
    ids of the synthetic source, so the coordinator's stream order applies unchanged."""

    index: int
    replayable = True

    def batches(self, batch_size: int, *, start_step: int = 0) -> Iterator[Batch]:
        raise NotImplementedError("a fake shard has batch ids, not batches")
