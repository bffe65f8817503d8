"""Placing gangs and starting their ranks, and ending them.

:class:`JobPlacement` is a part of the job with state of its own: the placement group of every
live gang (one for the whole job under ``replicas_within_host``) and the job ranks whose actor was
started and not yet ended. It asks for the placement groups of a whole job of the topology's shape
(at the start, and again after a total loss) and starts its ranks once the loop
(:mod:`actors.job_loop`, state ``Placing``) saw them ready, with a ``placement_waiting`` event
while it waits, as :func:`~raytrec.elastic.boundary.decide` says; it starts one rank actor per
job rank and ends the actors and placement groups of gangs that are dropped, drained or given
up. Each gang goes to a failure domain of its own where the cluster has room
(:class:`~raytrec.cluster.domain_placement.GangDomains`). It sees the job through
:class:`PlacementPorts` (the ports it calls), and a rank is started with
:class:`RankTemplate`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torchrec.distributed.types import ShardingPlan

from actors.job import RanksAdded
from actors.nodes import JobNodes
from actors.ports import HasClock, HasEvents, HasShared, HasStep
from raytrec.cluster.capacity import describe_bundles, describe_nodes, gangs_that_fit
from raytrec.cluster.domain_placement import GangDomains
from raytrec.cluster.placement import PlacementSpec, placement_specs, rank_resources
from raytrec.cluster.topology import Layout
from raytrec.config import ScalingConfig, TrainConfig
from raytrec.data.spec import FeatureSpec
from raytrec.elastic.boundary import PlacementSeen, gangs_to_place
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.decisions import Fail, Stop
from raytrec.elastic.events import PlacementWaiting
from raytrec.elastic.membership import Gang
from raytrec.elastic.workers import Placement, WorkerGroup
from raytrec.engine.rank_engine import RankSpec, StoreAddress
from raytrec.models import ModelFactory

__all__ = ["PLACEMENT_REPORT_S", "JobPlacement", "PendingJob", "PlacementPorts", "RankTemplate"]

#: While the job's placement groups are pending, a ``placement_waiting`` event this often.
PLACEMENT_REPORT_S = 30.0


@dataclasses.dataclass(kw_only=True)
class PendingJob:
    """A whole job's placement groups, asked for and not started yet (``pgs``: one per
    topology gang; one pinned to a failure domain whose room was taken is asked for again)."""

    gangs: tuple[Gang, ...]
    shard_of: Callable[[int], Any]
    specs: tuple[PlacementSpec, ...]
    pgs: list[Placement]
    asked: str  # what was asked, in words
    since: float  # the clock's monotonic time when asked
    ready: list[Placement] = dataclasses.field(default_factory=list)  # ready when last seen


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankTemplate:
    """What every rank of the job is started with besides its place and the job's store: the
    job's whole config (a rank reads most of it), the sharding plan, the dense width, the model
    factory, the row layout and the collective timeout (``elastic.collective_timeout_s``)."""

    config: TrainConfig
    plan: ShardingPlan
    num_dense: int
    model_factory: ModelFactory
    features: FeatureSpec | None
    timeout_s: float

    def spec(
        self, *, rank: int, gang: int, gang_rank: int, gang_size: int, store: StoreAddress
    ) -> RankSpec:
        """The spec of job rank ``rank``, rank ``gang_rank`` of gang ``gang``."""
        return RankSpec(
            rank=rank,
            gang=gang,
            gang_rank=gang_rank,
            gang_size=gang_size,
            config=self.config,
            plan=self.plan,
            num_dense=self.num_dense,
            store=store,
            model_factory=self.model_factory,
            timeout_s=self.timeout_s,
            features=self.features,
        )


class PlacementPorts(HasStep, HasEvents, HasClock, HasShared, Protocol):
    """The ports :class:`JobPlacement` calls."""


class JobPlacement:
    """The job's placement groups and started rank actors. What a rank is started with:
    ``ranks`` (:class:`RankTemplate`) and the job's store (``store()``, once hosted)."""

    def __init__(
        self,
        job: PlacementPorts,
        *,
        run_dir: str,
        scaling: ScalingConfig,
        elastic: ElasticConfig,
        ranks: RankTemplate,
        store: Callable[[], StoreAddress | None],
        group: WorkerGroup,
        nodes: JobNodes,
    ) -> None:
        self.job = job
        self.scaling = scaling
        self.elastic = elastic
        self.topology = scaling.topology()
        self.ranks = ranks
        self.store = store
        self.group = group
        self.nodes = nodes
        # Placement group names are unique in the Ray session: the run's name and a random tag.
        self.prefix = f"{os.path.basename(run_dir)}-{secrets.token_hex(3)}"
        self.pgs: dict[int, Placement] = {}  # gang id -> its placement group
        self.started: set[int] = set()  # job ranks whose process was started and not ended
        # Each gang in a failure domain of its own (raytrec.cluster.domain_placement).
        self.domains = GangDomains(
            domain=scaling.domain(),
            group=group,
            clock=job.clock,
            wait_s=elastic.domain_wait_s,
            record=job.record,
            stamp=lambda: (job.now(), job.step()),
            enabled=self.topology.layout is Layout.REPLICAS_ACROSS_HOSTS,
        )

    def request_job(self, gangs: Sequence[Gang], shard_of: Callable[[int], Any]) -> PendingJob:
        """Asks for the placement groups of a whole job of the topology's shape, topology gang
        ``i`` as ``gangs[i]``, job rank ``r`` to read ``shard_of(r)``. Until they are ready
        they are pending (the demand an autoscaler sees); the loop waits for them
        (:meth:`wait_ready`) as :func:`~raytrec.elastic.boundary.decide` says, then
        :meth:`start_job` or :meth:`give_up`."""
        across = self.topology.layout is Layout.REPLICAS_ACROSS_HOSTS
        # Under replicas_across_hosts, the first len(gangs) topology gangs (a job placed again
        # from a checkpoint may ask for fewer: gangs_to_place); else the whole job, one group.
        first = tuple(range(len(gangs))) if across else None
        specs = placement_specs(self.topology, per_rank=self.per_rank(), gangs=first)
        # Names stay unique when a rebuilt job is placed again in a later generation.
        generation = self.job.view.membership.generation
        suffix = f"-gen{generation}" if generation else ""
        pgs = self.domains.place_all(specs, [f"{self.prefix}-{s.name}{suffix}" for s in specs])
        return PendingJob(
            gangs=tuple(gangs),
            shard_of=shard_of,
            specs=tuple(specs),
            pgs=pgs,
            asked=describe_bundles(specs),
            since=self.job.clock.monotonic(),
        )

    def gangs_to_place(self) -> int:
        """How many gangs a job placed again from a checkpoint asks for
        (:func:`~raytrec.elastic.boundary.gangs_to_place`): as many of the initial ones as the
        live nodes that are not draining hold, down to ``elastic.min_gangs``. Under
        ``replicas_within_host`` the whole job (it is placed as one unit)."""
        initial = self.topology.num_gangs
        if self.topology.layout is not Layout.REPLICAS_ACROSS_HOSTS:
            return initial
        specs = placement_specs(self.topology, per_rank=self.per_rank())
        draining = self.group.draining_nodes()
        room = [n.resources for n in self.group.nodes() if n.alive and n.node_id not in draining]
        fitting = gangs_that_fit([s.bundles for s in specs], room)
        return gangs_to_place(initial=initial, fitting=fitting, min_gangs=self.elastic.min_gangs)

    def wait_ready(self, pending: PendingJob) -> PlacementSeen:
        """Waits a while for ``pending`` to be ready (a ``placement_waiting`` event says it
        waits every ``PLACEMENT_REPORT_S``, at least three times before giving up)."""
        wait_s = self.elastic.resource_wait_s
        left = pending.since + wait_s - self.job.clock.monotonic()
        every = min(PLACEMENT_REPORT_S, wait_s / 3)
        pending.ready = self.group.ready(pending.pgs, timeout=max(0.0, min(every, left)))
        return PlacementSeen(
            ready=len(pending.ready) == len(pending.pgs), since=pending.since, asked=pending.asked
        )

    def waiting(self, pending: PendingJob) -> None:
        """Records that the job waits for ``pending``."""
        # Pinned to a domain whose room was taken meanwhile: placed where Ray chooses.
        pending.pgs = self.domains.unpin(pending.pgs, pending.ready)
        self.job.record(
            PlacementWaiting(
                at=self.job.now(),
                step=self.job.step(),
                waited_s=round(self.job.clock.monotonic() - pending.since, 1),
                wait_s=self.elastic.resource_wait_s,
                asked=pending.asked,
                nodes=describe_nodes(self.group.nodes()),
            )
        )

    def give_up(self, pending: PendingJob, decision: Fail | Stop) -> str:
        """Releases ``pending``, leaving nothing behind; returns why, in words."""
        for pg in pending.pgs:
            self.group.release(pg)
        if isinstance(decision, Stop):  # `ray job stop` while it waited, say
            return decision.reason
        nodes = describe_nodes(self.group.nodes())
        return f"{decision.reason}; the cluster's live nodes: {nodes}"

    def start_job(self, pending: PendingJob) -> None:
        """Starts the rank actors of ``pending``, now placed."""
        across = self.topology.layout is Layout.REPLICAS_ACROSS_HOSTS
        for spec, pg in zip(pending.specs, pending.pgs, strict=True):
            for bundle, ranks in enumerate(spec.ranks):
                for t in ranks:
                    pos = self.topology.position(t)
                    gang = pending.gangs[pos.gang]
                    self.pgs[gang.gang_id if across else -1] = pg  # within: one for the job
                    r = gang.ranks[pos.gang_rank].job_rank
                    shard = pending.shard_of(r)
                    self.start_rank(r, gang.gang_id, pos.gang_rank, pg, bundle, shard)
        if across:
            for g, pg in enumerate(pending.pgs):
                self.domains.placed(pending.gangs[g].gang_id, pg)

    def per_rank(self) -> dict[str, float]:
        scaling = self.scaling
        return rank_resources(cpus_per_rank=scaling.cpus_per_rank, use_gpu=scaling.use_gpu)

    def start_rank(
        self,
        rank: int,
        gang: int,
        gang_rank: int,
        pg: Placement,
        bundle: int,
        shard: Any,
        *,
        account: bool = True,
    ) -> None:
        """Starts rank ``rank``'s actor; ``account``: it trains from this step on (a gang built
        in the background is booked when it joins)."""
        store = self.store()
        assert store is not None
        spec = self.ranks.spec(
            rank=rank,
            gang=gang,
            gang_rank=gang_rank,
            gang_size=self.topology.gang_size,
            store=store,
        )
        self.group.start_rank(spec, shard, placement=pg, bundle=bundle)
        self.started.add(rank)
        if account:
            self.job.apply(RanksAdded({rank: getattr(shard, "index", rank)}, self.job.step()))

    def keep(self, gang_id: int, pg: Placement) -> None:
        """The placement group of a gang placed by growth."""
        self.pgs[gang_id] = pg
        self.domains.placed(gang_id, pg)

    def kill_gang(self, gang_id: int, *, lost: bool = False, evicted: bool = False) -> None:
        """Ends a gang; ``lost``: it failed, ``evicted``: it was a straggler (its replacement
        goes to another failure domain where the cluster has room)."""
        self.domains.dropped(gang_id, lost=lost, evicted=evicted)
        self.release(gang_id, self.job.view.membership.gang(gang_id).job_ranks)

    def release(self, gang_id: int, ranks: Sequence[int]) -> None:
        """Kills the gang's rank actors and removes its placement group."""
        self.domains.dropped(gang_id)
        for r in ranks:
            self.group.kill(r)
            self.started.discard(r)
            self.nodes.forget(r)
        pg = self.pgs.pop(gang_id, None)
        if pg is not None:
            self.group.release(pg)

    def shutdown(self) -> None:
        for r in sorted(self.started):
            self.group.kill(r)
        self.started.clear()
        for pg in self.pgs.values():
            self.group.release(pg)
        self.pgs.clear()
        self.domains.clear()
