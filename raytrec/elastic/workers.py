"""The coordinator's seam to the processes it drives: the worker group and the clock.

The coordinator (:mod:`actors.coordinator`) never talks to Ray directly. It starts ranks, calls
their methods, waits for the answers, kills ranks, reads their progress, places and releases
gang placement groups and reads the node table through a :class:`WorkerGroup`, and reads the
time from a :class:`Clock`. :class:`actors.worker_group.RayWorkerGroup` is the Ray
implementation; the tests and the fault-space simulation run ranks in-process with a frozen
clock behind the same seam, so the real control loop is tested without Ray (Ray Train v2 tests
its controller the same way).

A call is a function of a rank (:class:`~raytrec.elastic.rank_protocol.RankProtocol`) and its
job rank: ``group.call(ranks, lambda w, r: w.replay(ids[r]))``. Mypy checks the method, its
arguments and its answer's type (``Answer[R]``, whose ``result`` is an ``R``) at every call
site, so a renamed method or a changed signature breaks the type check rather than a running
job. Failures come back as two exceptions whatever the implementation: :class:`RankLost` (the
rank's process or node is gone) and :class:`RankFailed` (the rank raised; ``cause`` is its own
exception).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from raytrec.cluster.placement import PlacementSpec
    from raytrec.data.source import BatchShard
    from raytrec.elastic.rank_protocol import RankProtocol
    from raytrec.engine.rank_engine import RankSpec, StoreAddress

__all__ = [
    "NODE_DIED",
    "PEER_RELEASED",
    "Answer",
    "Clock",
    "NodeInfo",
    "Placement",
    "RankCallError",
    "RankFailed",
    "RankLost",
    "RankTimedOut",
    "SystemClock",
    "WorkerGroup",
]

R = TypeVar("R")


class Answer(Generic[R]):
    """A call's answer still to come, an ``R`` once done (:meth:`WorkerGroup.result`): the
    rank it went to and the method called. Each worker group subclasses it with what it
    waits on (an ObjectRef, for Ray)."""

    rank: int
    method: str


#: A placement group requested from the cluster.
Placement = Any

#: Why a rank is gone when its node went with it (events and tests compare against it).
NODE_DIED = "its node died"
#: Why a rank the coordinator ended on purpose is gone: its gang lost another rank, so the gang
#: was dropped (a consequence of that failure, not a failure of its own).
PEER_RELEASED = "its gang lost a rank"


class RankCallError(Exception):
    """A call on a rank did not return its answer."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RankLost(RankCallError):
    """The rank's process is gone (it died, was killed, or its node left the cluster)."""

    def __init__(self, rank: int, cause: str, *, node_died: bool = False) -> None:
        super().__init__(rank, cause)
        self.cause = cause
        self.node_died = node_died


class RankFailed(RankCallError):
    """The rank raised; ``cause`` is its own exception (a BadInputError keeps its fields)."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        text = str(cause).strip().splitlines()
        super().__init__(rank, f"{type(cause).__name__}: {text[0][:200] if text else ''}")
        self.cause = cause


class RankTimedOut(RankCallError):
    """A control call did not return on ``ranks`` in time: they are stuck (in a collective
    whose peer hangs, say), alive or not."""

    def __init__(self, ranks: Sequence[int], message: str) -> None:
        super().__init__(ranks[0], message)
        self.ranks = tuple(ranks)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """A node of the cluster as the node table shows it."""

    node_id: str
    address: str
    alive: bool
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # Ray's node labels


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def perf_counter(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def perf_counter(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class WorkerGroup(Protocol):
    """Everything the coordinator does to processes and the cluster (module doc)."""

    def host_store(self) -> StoreAddress:
        """Hosts the job's rendezvous store on this node; returns where it listens."""
        ...

    def start_rank(
        self, spec: RankSpec, shard: BatchShard, *, placement: Placement, bundle: int
    ) -> None:
        """Starts rank ``spec.rank``'s process in bundle ``bundle`` of ``placement``."""
        ...

    def call(
        self, ranks: Sequence[int], invoke: Callable[[RankProtocol, int], R]
    ) -> dict[int, Answer[R]]:
        """Calls one method on every rank of ``ranks``: ``invoke(rank, job_rank)`` names it
        and its arguments (module doc); returns job rank -> its answer to come."""
        ...

    def wait(
        self, futures: Sequence[Answer[Any]], *, num_returns: int, timeout: float
    ) -> list[Answer[Any]]:
        """The futures that are done after at most ``timeout`` seconds (at least
        ``num_returns`` of them unless the time ran out)."""
        ...

    def result(self, future: Answer[R]) -> R:
        """A done future's value; raises :class:`RankLost` or :class:`RankFailed`."""
        ...

    def kill(self, rank: int) -> None:
        """Ends the rank's process (no-op when it is gone)."""
        ...

    def progress(self, ranks: Sequence[int]) -> dict[int, int]:
        """The last step each rank finished, as it reports while it trains (its heartbeat);
        ranks that have not reported are left out."""
        ...

    def place(self, spec: PlacementSpec, *, name: str = "") -> Placement:
        """Requests a placement group (pending until the cluster can hold it); a ``name``
        must be unique in the cluster."""
        ...

    def ready(self, placements: Sequence[Placement], *, timeout: float) -> list[Placement]:
        """The placements that are ready after at most ``timeout`` seconds."""
        ...

    def release(self, placement: Placement) -> None:
        """Removes a placement group (pending or ready)."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """The cluster's node table."""
        ...

    def draining_nodes(self) -> set[str]:
        """Node ids the cluster marked for removal (an autoscaler, a preemption notice)."""
        ...

    def available(self) -> dict[str, dict[str, float]]:
        """Node id -> the resources free on it now, for each live node."""
        ...

    def placed_nodes(self, placement: Placement) -> tuple[str, ...]:
        """The node id of each bundle of a ready placement."""
        ...
