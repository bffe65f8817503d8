"""What a part of the coordinator may do to the job: narrow ports instead of the coordinator.

A component holding the whole :class:`~actors.coordinator.Coordinator` can change anything, so
a reader has to read everything. A component holding :class:`JobPorts` can call methods on
ranks, ask for a job-wide sync, read the step, the clock and the cluster's nodes, and record
events; it returns what it found, and the coordinator applies it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from raytrec.elastic.events import Event
from raytrec.elastic.rank_protocol import RankProtocol
from raytrec.elastic.workers import Clock, NodeInfo

__all__ = ["JobPorts", "RankCalls"]

R = TypeVar("R")


class RankCalls(Protocol):
    """Calls one method on ``ranks`` (``invoke``, as in ``WorkerGroup.call``) and returns their
    answers in order; raises ``RankLost`` or ``RankFailed`` for the first rank whose call
    failed."""

    def __call__(
        self, ranks: list[int], invoke: Callable[[RankProtocol, int], R], /
    ) -> list[R]: ...


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
