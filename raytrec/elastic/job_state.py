"""What the elastic policy knows: the membership plus everything observed since.

The coordinator turns what Ray and the ranks tell it into :data:`Observation` values (a rank
exited, a node was lost, a rank finished a step or timed out in a collective, a placement group
became ready, a replica sync completed) and folds them into an :class:`ElasticState` with
:func:`observe`, which also returns the events they are logged as. Failures are only recorded
here; :func:`raytrec.elastic.policy.decide_membership` turns them into one decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from raytrec.cluster.topology import Topology
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import Event, GangPlaced, NodeDied, RankDied
from raytrec.elastic.membership import Membership

__all__ = [
    "CollectiveTimeout",
    "ElasticState",
    "NodeLost",
    "Observation",
    "PlacementReady",
    "RankExited",
    "StepDone",
    "SyncDone",
    "observe",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankExited:
    """A rank's actor died (Ray's ``ActorDiedError``, or a process exit)."""

    job_rank: int
    at: float
    cause: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeLost:
    """A node left the cluster, with every rank on it."""

    node: int
    at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepDone:
    """A rank finished training step ``step`` (steps count from 1)."""

    job_rank: int
    step: int
    at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveTimeout:
    """A rank gave up waiting in a collective of step ``step``: it is alive and waiting for a
    peer, so it is not the one that hangs."""

    job_rank: int
    step: int
    at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementReady:
    """One requested gang placement group became ready; ``nodes[k]`` hosts gang rank k."""

    nodes: tuple[int, ...]
    at: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncDone:
    """Every live gang completed the replica sync at ``step``."""

    step: int
    at: float


Observation = RankExited | NodeLost | StepDone | CollectiveTimeout | PlacementReady | SyncDone


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElasticState:
    """The membership and the not-yet-acted-on observations; a pure value."""

    membership: Membership
    sync_every: int
    #: Most gangs the job may have (``ElasticConfig.max_gangs`` resolved).
    max_gangs: int
    #: Highest step any live rank finished.
    step: int = 0
    #: Job rank -> (last step it finished, when).
    progress: Mapping[int, tuple[int, float]] = dataclasses.field(default_factory=dict)
    #: Ranks that reported a collective timeout since their last finished step.
    timed_out: frozenset[int] = frozenset()
    dead_ranks: frozenset[int] = frozenset()
    dead_nodes: frozenset[int] = frozenset()
    #: Gang placement groups requested and not ready yet.
    outstanding: int = 0
    #: Ready placements not used yet: nodes per gang rank.
    ready: tuple[tuple[int, ...], ...] = ()
    #: A step was started and aborted (a collective timed out) since the last sync, so the
    #: survivors' copies hold updates of a step that never finished.
    step_aborted: bool = False
    #: When the job fell below min_gangs and started waiting; None while it is not waiting.
    waiting_since: float | None = None
    #: Why the job failed, once it has, and the setting that bears on it.
    failed: str | None = None
    failed_key: str | None = None

    @classmethod
    def initial(
        cls, topology: Topology, *, config: ElasticConfig, sync_every: int, now: float
    ) -> ElasticState:
        """Generation 0 of ``topology``; every rank counts as having made progress at ``now``."""
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
        membership = Membership.initial(topology)
        return cls(
            membership=membership,
            sync_every=sync_every,
            max_gangs=config.resolved_max_gangs(membership.num_gangs),
            progress={r: (0, now) for g in membership.gangs for r in g.job_ranks},
        )

    @property
    def lost_ranks(self) -> frozenset[int]:
        """Live-gang ranks that exited or sat on a lost node."""
        on_nodes = {
            s.job_rank for g in self.membership.gangs for s in g.ranks if s.node in self.dead_nodes
        }
        return self.dead_ranks | on_nodes

    @property
    def at_sync_boundary(self) -> bool:
        """Whether the job stands right after a completed sync, with every replica identical
        (so a new gang may copy any live peer)."""
        return self.membership.last_sync_step == self.step and not self.step_aborted

    @property
    def next_sync_step(self) -> int:
        """The step of the next sync that leaves every replica identical."""
        k = self.sync_every
        if self.at_sync_boundary or (self.step % k == 0 and not self.step_aborted):
            return self.step
        return (self.step // k + 1) * k

    def restart_clocks(self, now: float) -> Mapping[int, tuple[int, float]]:
        """Progress of the live ranks with their clocks restarted at ``now`` (after a pause or
        a re-formation, silence so far is no sign of a hang)."""
        return {r: (self.step, now) for g in self.membership.gangs for r in g.job_ranks}


def observe(
    state: ElasticState, observations: Iterable[Observation]
) -> tuple[ElasticState, tuple[Event, ...]]:
    """Folds observations into the state; returns it and the events to log."""
    m = state.membership
    progress = dict(state.progress)
    timed_out = set(state.timed_out)
    dead_ranks, dead_nodes = set(state.dead_ranks), set(state.dead_nodes)
    ready = list(state.ready)
    outstanding, step, aborted = state.outstanding, state.step, state.step_aborted
    events: list[Event] = []
    for o in observations:
        if isinstance(o, RankExited):
            gang = m.gang_of_rank(o.job_rank)
            # A rank of a gang that was already dropped: the coordinator's own clean-up.
            if gang is not None and o.job_rank not in dead_ranks:
                dead_ranks.add(o.job_rank)
                events.append(
                    RankDied(at=o.at, step=step, job_rank=o.job_rank, gang_id=gang, cause=o.cause)
                )
        elif isinstance(o, NodeLost):
            if o.node in dead_nodes:
                continue
            dead_nodes.add(o.node)
            events.append(
                NodeDied(at=o.at, step=step, node=o.node, gang_ids=m.gangs_on_nodes([o.node]))
            )
            # Ray puts a placement group that lost a node back into the pending queue.
            kept = [p for p in ready if o.node not in p]
            outstanding += len(ready) - len(kept)
            ready = kept
        elif isinstance(o, StepDone):
            if m.gang_of_rank(o.job_rank) is not None:
                progress[o.job_rank] = (o.step, o.at)
                timed_out.discard(o.job_rank)
                step = max(step, o.step)
        elif isinstance(o, CollectiveTimeout):
            if m.gang_of_rank(o.job_rank) is not None:
                timed_out.add(o.job_rank)
                aborted = True
        elif isinstance(o, PlacementReady):
            if outstanding < 1:
                raise ValueError("a placement became ready that was never requested")
            if len(o.nodes) != m.gang_size:
                raise ValueError(
                    f"placement names {len(o.nodes)} nodes; one per gang rank is needed "
                    f"(gang_size={m.gang_size})"
                )
            outstanding -= 1
            nodes = tuple(o.nodes)
            if dead_nodes & set(nodes):
                outstanding += 1  # placed on a node already lost: pending again
                continue
            ready.append(nodes)
            events.append(GangPlaced(at=o.at, step=step, nodes=tuple(f"node {n}" for n in nodes)))
        elif isinstance(o, SyncDone):
            m = m.synced(o.step)
            step = max(step, o.step)
            aborted = False
        else:
            raise TypeError(f"not an observation: {o!r}")
    new = dataclasses.replace(
        state,
        membership=m,
        step=step,
        progress=progress,
        timed_out=frozenset(timed_out),
        dead_ranks=frozenset(dead_ranks),
        dead_nodes=frozenset(dead_nodes),
        outstanding=outstanding,
        ready=tuple(ready),
        step_aborted=aborted,
    )
    return new, tuple(events)
