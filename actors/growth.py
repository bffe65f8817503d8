"""The coordinator's growth: pending placement demand, gangs built in the background, joins.

The coordinator keeps one pending placement group per gang the job could still add (up to
``elastic.max_gangs`` with ``elastic.grow``, else back to ``elastic.min_gangs``): on an autoscaling
cluster that pending demand is what adds nodes, a whole gang at a time. A gang whose placement
becomes ready is started and built (its actors import, join their gang world and shard the model:
seconds) while the live gangs keep training. Once every rank of it is built it joins at the next
interval boundary: a job-wide sync among the live gangs, a new generation including it, and a
broadcast of the full state from a live peer gang. The survivors pause only for that join.
Below ``elastic.min_gangs`` training waits for placements, up to ``elastic.resource_wait_s``.

A mixin of :class:`~actors.coordinator.Coordinator`, which provides the state and the methods
declared in the class body; it lives here to keep the coordinator's module to its control loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from actors.rank import RankWorker
from raytrec.config import TrainConfig
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import (
    EventLog,
    GangHealed,
    GangJoined,
    GangPlaced,
    GangRequested,
    HealFailed,
    JobFailed,
    ResourcesWaited,
)
from raytrec.elastic.heal import failed_heals
from raytrec.elastic.membership import Gang, Membership
from raytrec.elastic.report import RankInfo
from raytrec.elastic.workers import Clock, Placement, RankCallError, WorkerGroup
from raytrec.errors import JobFailedError
from raytrec.placement import placement_specs, rank_resources
from raytrec.topology import Layout, Topology

__all__ = ["Building", "GangGrowth"]


@dataclasses.dataclass
class Building:
    """A gang started in the background: its reserved slots and each rank's ``build`` call."""

    gang: Gang
    builds: dict[int, Any]  # job rank -> the future of its build()


class GangGrowth:
    """Grows the coordinator's job by whole gangs (module doc)."""

    # Provided by the coordinator.
    cfg: TrainConfig
    topology: Topology
    elastic: ElasticConfig
    membership: Membership
    accounting: BatchAccounting
    events: EventLog
    step: int
    end_step: int
    streams_table: Any  # StreamTable of a re-shared source, or None
    max_gangs: int
    new_shard: Any  # job rank -> BatchShard, or None
    group: WorkerGroup
    clock: Clock
    _pending: list[Placement]
    _building: dict[int, Building]
    _shards_of_new: dict[int, Any]
    _pgs: dict[int, Placement]
    _rank_nodes: dict[int, str]
    _joining: set[int]
    _ready: int  # batches every live rank holds prepared beyond ``step``

    if TYPE_CHECKING:

        def _now(self) -> float: ...
        def _node(self, node_id: str) -> int: ...
        def _live_ranks(self) -> list[int]: ...
        def _ranks_in_gang_order(self) -> list[int]: ...
        def _commit_all(self) -> None: ...
        def _with_nodes(self, gangs: Sequence[Gang]) -> tuple[Gang, ...]: ...
        def _new_generation(self, *, reason: str) -> None: ...
        def _release(self, gang_id: int, ranks: Sequence[int]) -> None: ...
        def _reshare_rows(self, ranks: Sequence[int], *, joining: Sequence[int] = ()) -> bool: ...
        def _call(
            self, ranks: list[int], method: Callable[..., Any], *args: Any, **kwargs: Any
        ) -> list[Any]: ...
        def _start_rank(
            self,
            rank: int,
            gang: int,
            gang_rank: int,
            pg: Placement,
            bundle: int,
            shard: Any,
            *,
            account: bool = True,
        ) -> None: ...

    def _request_growth(self) -> None:
        """Keeps one pending placement group per gang the job could still add."""
        if not self.elastic.grow and self.membership.num_gangs >= self.elastic.min_gangs:
            return
        if self.topology.layout is not Layout.REPLICAS_ACROSS_HOSTS or self.new_shard is None:
            return
        cap = self.max_gangs if self.elastic.grow else self.elastic.min_gangs
        want = cap - self.membership.num_gangs - len(self._pending) - len(self._building)
        if want <= 0:
            return
        per_rank = rank_resources(
            cpus_per_rank=self.cfg.scaling.cpus_per_rank, use_gpu=self.cfg.scaling.use_gpu
        )
        spec = placement_specs(self.topology, per_rank=per_rank, gangs=(0,))[0]
        for _ in range(want):
            self._pending.append(self.group.place(spec))
        self.events.append(
            GangRequested(
                at=self._now(), step=self.step, count=want, outstanding=len(self._pending)
            )
        )

    def _admit_new_gangs(self) -> None:
        """Starts building the gangs whose placement became ready, and joins the built ones.

        Building a gang (its ranks' imports, gang world and sharded model: seconds) runs in the
        background while the live gangs train; they pause only for the join itself, at an
        interval boundary, once every rank of the new gang is built.
        """
        self._start_ready_gangs()
        self._join_built_gangs()

    def _start_ready_gangs(self) -> None:
        if not self._pending:
            return
        ready = self.group.ready(self._pending, timeout=0)
        if not ready:
            return
        self._pending = [pg for pg in self._pending if pg not in ready]
        gangs, self.membership = self.membership.reserve(
            [[0] * self.topology.gang_size for _ in ready]  # nodes filled in once built
        )
        for gang, pg in zip(gangs, ready, strict=True):
            self._pgs[gang.gang_id] = pg
            for slot in gang.ranks:
                shard = self.new_shard(slot.job_rank)
                self._start_rank(
                    slot.job_rank, gang.gang_id, slot.gang_rank, pg, 0, shard, account=False
                )
            builds = self.group.call(gang.job_ranks, RankWorker.build)
            self._building[gang.gang_id] = Building(gang=gang, builds=builds)

    def _join_built_gangs(self) -> None:
        """Joins every gang whose ranks are all built; drops (and asks again for) a gang that
        lost a rank while building."""
        built: list[Building] = []
        for gid, b in list(self._building.items()):
            futures = list(b.builds.values())
            done = self.group.wait(futures, num_returns=len(futures), timeout=0)
            failed = False
            for future in done:
                try:
                    self.group.result(future)
                except RankCallError:
                    failed = True  # e.g. its node went away; a peer's build would wait it out
            if failed:
                del self._building[gid]
                self._abandon_building(b.gang)
                self._request_growth()
            elif len(done) == len(futures):
                del self._building[gid]
                built.append(b)
        if not built:
            return
        new_ranks: list[int] = []
        for b in built:
            infos: list[RankInfo] = [self.group.result(f) for f in b.builds.values()]
            for info in infos:
                self._rank_nodes[info.rank] = info.node_id
                self._node(info.node_id)
            new_ranks += b.gang.job_ranks
            nodes = tuple(self._node(self._rank_nodes[r]) for r in b.gang.job_ranks)
            self.events.append(GangPlaced(at=self._now(), step=self.step, nodes=nodes))
        # Join at a sync boundary: the live gangs agree first, so the peer's state is the job's.
        try:
            self._call(self._live_ranks(), RankWorker.sync)
        except RankCallError:
            # A survivor failed: recovery takes over; the new gangs, not members yet, are let
            # go (their placement is requested again once the job has re-formed).
            for b in built:
                self._abandon_building(b.gang)
            raise
        self._commit_all()
        peer = self.membership.gangs[0].gang_id
        gangs = self._with_nodes([b.gang for b in built])
        reshare = self.streams_table is not None
        for r in new_ranks:  # they train from this step on
            shard = self._shards_of_new.pop(r)
            if not reshare:  # else booked with the share they are given below
                self.accounting.add_rank(r, shard=getattr(shard, "index", r), step=self.step)
        self.membership = self.membership.with_gangs(gangs, step=self.step)
        self._joining = {g.gang_id for g in gangs}
        self.accounting.add_gangs(g.gang_id for g in gangs)
        self._new_generation(reason=f"gangs {[g.gang_id for g in gangs]} joined")
        self._call(new_ranks, RankWorker.set_step, self.step)
        self._call(
            self._live_ranks(), RankWorker.broadcast_state, self.membership.member_index(peer)
        )
        gangs = tuple(self._verify_heals(gangs, peer=peer))
        new_ranks = [r for g in gangs for r in g.job_ranks]
        self._reshare_rows(self._ranks_in_gang_order(), joining=new_ranks)
        self._joining = set()
        for g in gangs:
            self.events.append(
                GangHealed(at=self._now(), step=self.step, gang_id=g.gang_id, peer_gang_id=peer)
            )
            self.events.append(
                GangJoined(
                    at=self._now(),
                    step=self.step,
                    gang_id=g.gang_id,
                    generation=self.membership.generation,
                )
            )
        # Ranks given a new share have nothing read yet (the others read ahead already).
        ready = self._live_ranks() if reshare else new_ranks
        n = min(self.cfg.log_every, self.end_step - self.step)
        self._call(ready, RankWorker.prepare, n)
        # Every rank holds n now when all were given a new share; else the others hold what
        # they held (nothing, right after a recovery: they prepare before the next interval).
        self._ready = n if reshare else min(self._ready, n)

    def _verify_heals(self, gangs: Sequence[Gang], *, peer: int) -> list[Gang]:
        """Compares each joined gang's state with the peer it healed from, before any
        averaging (:func:`~raytrec.elastic.heal.failed_heals`); a gang that differs is dropped
        (a new generation without it), released and placed again. Returns the gangs that
        healed."""
        ranks = [*self.membership.gang(peer).job_ranks, *(r for g in gangs for r in g.job_ranks)]
        digests = dict(zip(ranks, self._call(ranks, RankWorker.state_digest), strict=True))
        failed = failed_heals(
            self.membership, peer=peer, joined=[g.gang_id for g in gangs], digests=digests
        )
        if not failed:
            return list(gangs)
        for gid, bad in sorted(failed.items()):
            self.events.append(
                HealFailed(
                    at=self._now(), step=self.step, gang_id=gid, peer_gang_id=peer, job_ranks=bad
                )
            )
        dropped = [g for g in gangs if g.gang_id in failed]
        if self.streams_table is None:  # else not booked until the rows are shared out
            for g in dropped:
                for r in g.job_ranks:
                    self.accounting.forget_rank(r)  # it trained nothing
        survivors = [g for g in self.membership.gang_ids if g not in failed]
        self.accounting.drop(
            list(failed), survivors, ranks_of=lambda g: self.membership.gang(g).job_ranks
        )
        self.membership = self.membership.without(failed)
        self._joining -= set(failed)
        self._new_generation(reason=f"gangs {sorted(failed)} did not heal")
        for g in dropped:
            self._release(g.gang_id, g.job_ranks)
        self._request_growth()
        return [g for g in gangs if g.gang_id not in failed]

    def _abandon_building(self, gang: Gang) -> None:
        self._release(gang.gang_id, gang.job_ranks)
        for r in gang.job_ranks:
            self._shards_of_new.pop(r, None)

    def _wait_for_min_gangs(self) -> None:
        if self.membership.num_gangs >= self.elastic.min_gangs:
            return
        deadline = self._now() + self.elastic.resource_wait_s
        self.events.append(
            ResourcesWaited(
                at=self._now(),
                step=self.step,
                live_gangs=self.membership.num_gangs,
                min_gangs=self.elastic.min_gangs,
                deadline=deadline,
            )
        )
        self._request_growth()
        while self.membership.num_gangs < self.elastic.min_gangs:
            if self._now() > deadline:
                reason = (
                    f"{self.membership.num_gangs} live gangs, fewer than elastic.min_gangs="
                    f"{self.elastic.min_gangs}, and no placement for more came within "
                    f"elastic.resource_wait_s={self.elastic.resource_wait_s:g}s"
                )
                self.events.append(JobFailed(at=self._now(), step=self.step, reason=reason))
                raise JobFailedError(reason)
            self.clock.sleep(self.elastic.poll_s)
            self._admit_new_gangs()
