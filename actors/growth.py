"""The coordinator's growth: pending placement demand, gangs built in the background, joins.

The coordinator keeps one pending placement group per gang the job could still add (up to
``elastic.max_gangs`` with ``elastic.grow``, else back to ``elastic.min_gangs``): on an autoscaling
cluster that pending demand is what adds nodes, a whole gang at a time. A gang whose placement
becomes ready is started and built (its actors import, join their gang world and shard the model:
seconds) while the live gangs keep training. Once every rank of it is built it joins at the next
interval boundary: a job-wide sync among the live gangs, a new generation including it, and a
broadcast of the full state from a live peer gang. The survivors pause only for that join.
Below ``elastic.min_gangs`` training waits for placements, up to ``elastic.resource_wait_s``
(the coordinator's loop, as :func:`~raytrec.elastic.boundary.decide` says).

A part of the job with state of its own (the placements requested, the gangs being built); it
sees the job through :class:`~actors.ports.GenerationPorts` and carries out the
:class:`~raytrec.elastic.decisions.Grow` that :func:`~raytrec.elastic.boundary.decide` returns
for the gangs built, and asks :func:`~raytrec.elastic.control.gangs_to_request` how much to keep
pending and :func:`~raytrec.elastic.heal.failed_heals` whether each healed. The membership, the
gangs joining and the ranks' prepared batches it changes are outcomes (:mod:`actors.job`) the
loop applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from actors.gang_placement import JobPlacement
from actors.job import (
    Committed,
    GangsAccounted,
    GangsDropped,
    GangsDroppedFromBooks,
    GangsJoined,
    Joining,
    Prepared,
    RanksAdded,
    RanksForgotten,
    Reserved,
)
from actors.nodes import JobNodes
from actors.ports import GenerationPorts
from actors.reshare import DataStreams
from raytrec.cluster.placement import placement_specs, rank_resources
from raytrec.cluster.topology import Layout
from raytrec.config import ScalingConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.control import gangs_to_request
from raytrec.elastic.decisions import Grow
from raytrec.elastic.events import (
    GangHealed,
    GangJoined,
    GangPlaced,
    GangRequested,
    HealFailed,
)
from raytrec.elastic.heal import failed_heals
from raytrec.elastic.membership import Gang
from raytrec.elastic.rank_protocol import ReformPlan
from raytrec.elastic.report import RankInfo
from raytrec.elastic.workers import Placement, RankCallError, WorkerGroup

__all__ = ["Building", "GangGrowth"]


@dataclasses.dataclass
class Building:
    """A gang started in the background: its reserved slots and each rank's ``build`` call."""

    gang: Gang
    builds: dict[int, Any]  # job rank -> the future of its build()


class GangGrowth:
    """Grows the job by whole gangs (module doc). Owns the placements requested for gangs not
    started yet, the gangs being built and their data shards. ``new_shard``: job rank -> the
    data shard a rank of a new gang starts with (None: no data for a new gang)."""

    def __init__(
        self,
        job: GenerationPorts,
        *,
        elastic: ElasticConfig,
        scaling: ScalingConfig,
        log_every: int,
        group: WorkerGroup,
        placement: JobPlacement,
        nodes: JobNodes,
        streams: DataStreams,
        new_shard: Callable[[int], Any] | None,
    ) -> None:
        self.job = job
        self.elastic = elastic
        self.scaling = scaling
        self.log_every = log_every  # steps per interval: what a joined gang prepares
        self.topology = scaling.topology()
        self.group = group
        self.placement = placement
        self.nodes = nodes
        self.streams = streams
        self.new_shard = new_shard
        self.pending: list[Placement] = []  # requested for gangs not started yet
        self.building: dict[int, Building] = {}  # gang id -> a new gang being built
        self.shards_of_new: dict[int, Any] = {}  # job rank -> its data shard, until it joins

    def request(self) -> None:
        """Keeps one pending placement group per gang the job could still add
        (:func:`~raytrec.elastic.control.gangs_to_request`)."""
        job, elastic = self.job, self.elastic
        if self.topology.layout is not Layout.REPLICAS_ACROSS_HOSTS or self.new_shard is None:
            return  # one placement group for the whole job, or no data for a new gang
        want = gangs_to_request(
            live=job.view.membership.num_gangs,
            outstanding=len(self.pending) + len(self.building),
            max_gangs=job.view.max_gangs,
            min_gangs=elastic.min_gangs,
            grow=elastic.grow,
        )
        if want <= 0:
            return
        scaling = self.scaling
        per_rank = rank_resources(cpus_per_rank=scaling.cpus_per_rank, use_gpu=scaling.use_gpu)
        spec = placement_specs(self.topology, per_rank=per_rank, gangs=(0,))[0]
        self.pending += self.placement.domains.request(spec, want)
        job.record(
            GangRequested(at=job.now(), step=job.step(), count=want, outstanding=len(self.pending))
        )

    def fit_to_cap(self) -> None:
        """Gives back the placement requested beyond the job's gang cap."""
        while (
            self.pending
            and self.job.view.membership.num_gangs + len(self.pending) + len(self.building)
            > self.job.view.max_gangs
        ):
            self.group.release(self.pending.pop())

    def start_ready(self) -> None:
        """Starts building the gangs whose placement became ready. Building a gang (its ranks'
        imports, gang world and sharded model: seconds) runs in the background while the live
        gangs train; they pause only for the join itself (:meth:`join`), at an interval
        boundary, once every rank of the new gang is built."""
        if not self.pending:
            return
        # One that waited long enough for a failure domain of its own takes what has room.
        self.pending = self.placement.domains.relax(self.pending)
        ready = self.group.ready(self.pending, timeout=0)
        if not ready:
            return
        self.pending = [pg for pg in self.pending if pg not in ready]
        assert self.new_shard is not None  # else nothing was requested
        gangs, reserved = self.job.view.membership.reserve(
            [[0] * self.topology.gang_size for _ in ready]  # nodes filled in once built
        )
        self.job.apply(Reserved(reserved))
        for gang, pg in zip(gangs, ready, strict=True):
            self.placement.keep(gang.gang_id, pg)
            for slot in gang.ranks:
                shard = self.new_shard(self._unread_shard(slot.job_rank))
                self.placement.start_rank(
                    slot.job_rank, gang.gang_id, slot.gang_rank, pg, 0, shard, account=False
                )
                self.shards_of_new[slot.job_rank] = shard
            builds = self.group.call(gang.job_ranks, lambda w, _r: w.build())
            self.building[gang.gang_id] = Building(gang=gang, builds=builds)

    def _unread_shard(self, job_rank: int) -> int:
        """The shard of a rank added later: its job rank's, unless a rank read that shard
        already (a job resumed from a checkpoint numbers its ranks from 0 again, and the
        checkpoint's job may have had ranks added too): then one no rank has read."""
        streams = self.job.view.accounting.streams
        taken = streams.shards() if streams is not None else set()
        taken |= {int(getattr(s, "index", r)) for r, s in self.shards_of_new.items()}
        return job_rank if job_rank not in taken else max(taken) + 1

    def built(self) -> list[Building]:
        """The gangs whose every rank is built, taken out of :attr:`building` to join; drops
        (and asks again for) a gang that lost a rank while building."""
        built: list[Building] = []
        for gid, b in list(self.building.items()):
            futures = list(b.builds.values())
            done = self.group.wait(futures, num_returns=len(futures), timeout=0)
            failed = False
            for future in done:
                try:
                    self.group.result(future)
                except RankCallError:
                    failed = True  # e.g. its node went away; a peer's build would wait it out
            if failed:
                del self.building[gid]
                self.abandon(b.gang)
                self.request()
            elif len(done) == len(futures):
                del self.building[gid]
                built.append(b)
        return built

    def join(self, built: list[Building], decision: Grow) -> None:
        """Joins the ``built`` gangs as ``decision`` says: a job-wide sync among the live gangs,
        a new generation with them, a broadcast of the full state from the peer gang and a
        check that each healed."""
        new_ranks: list[int] = []
        for b in built:
            infos: list[RankInfo] = [self.group.result(f) for f in b.builds.values()]
            for info in infos:
                self.nodes.saw(info)
            new_ranks += b.gang.job_ranks
            nodes = self.nodes.rank_names(b.gang.job_ranks)
            self.job.record(GangPlaced(at=self.job.now(), step=self.job.step(), nodes=nodes))
        # Join at a sync boundary: the live gangs agree first, so the peer's state is the job's.
        try:
            self.job.call(self.job.live_ranks(), lambda w, _r: w.sync())
        except RankCallError:
            # A survivor failed: recovery takes over; the new gangs, not members yet, are let
            # go (their placement is requested again once the job has re-formed).
            for b in built:
                self.abandon(b.gang)
            raise
        self.job.apply(Committed())
        peer = decision.gangs[0].heal_from
        gangs = self.nodes.with_nodes([b.gang for b in built])
        reshare = self.streams.table is not None
        shards = {r: self.shards_of_new.pop(r) for r in new_ranks}
        if not reshare:  # they train from this step on; else booked with the share given below
            added = {r: getattr(shard, "index", r) for r, shard in shards.items()}
            self.job.apply(RanksAdded(added, self.job.step()))
        self.job.apply(GangsJoined(tuple(gangs)))
        self.job.apply(Joining(frozenset(g.gang_id for g in gangs)))
        self.job.apply(GangsAccounted(tuple(g.gang_id for g in gangs)))
        self.job.new_generation(f"gangs {[g.gang_id for g in gangs]} joined")
        # The new ranks take the job's step, then every member takes the peer's state.
        src = self.job.view.membership.member_index(peer)
        heal = ReformPlan(broadcast_state_from=src)
        heal_new = dataclasses.replace(heal, step=self.job.step())
        joined = set(new_ranks)
        self.job.call(
            self.job.live_ranks(), lambda w, r: w.reform(heal_new if r in joined else heal)
        )
        gangs = tuple(self._verify_heals(gangs, peer=peer))
        new_ranks = [r for g in gangs for r in g.job_ranks]
        fresh = self.streams.reshare(self.job.ranks_in_gang_order(), joining=new_ranks)
        self.job.apply(Joining(frozenset()))
        for g in gangs:
            self.job.record(
                GangHealed(
                    at=self.job.now(),
                    step=self.job.step(),
                    gang_id=g.gang_id,
                    peer_gang_id=peer,
                )
            )
            self.job.record(
                GangJoined(
                    at=self.job.now(),
                    step=self.job.step(),
                    gang_id=g.gang_id,
                    generation=self.job.view.membership.generation,
                )
            )
        # Ranks given a new stream have nothing read yet (the others read ahead already).
        ready = fresh if reshare else new_ranks
        n = min(self.log_every, self.job.view.end_step - self.job.step())
        self.job.call(ready, lambda w, _r: w.prepare(n))
        # Every rank holds n now when all were given a new stream; else the others hold what
        # they held (nothing, right after a recovery: they prepare before the next interval).
        everyone = set(ready) >= set(self.job.live_ranks())
        self.job.apply(Prepared(n if everyone else min(self.job.view.ready, n)))

    def _verify_heals(self, gangs: Sequence[Gang], *, peer: int) -> list[Gang]:
        """Compares every gang's state with the peer's after the broadcast, before any
        averaging (:func:`~raytrec.elastic.heal.failed_heals`). Every member took the peer's
        state, not only the joined gangs, so every member is checked: a joined gang that
        differs is dropped (a new generation without it), released and placed again; a member
        that differs is killed, so that the loss path drops its gang at its next call (as the
        start's broadcast does: nothing of it is uncommitted, the job-wide sync came first).
        Returns the joined gangs that healed."""
        m = self.job.view.membership
        ranks = self.job.live_ranks()
        digests = dict(
            zip(ranks, self.job.call(ranks, lambda w, _r: w.state_digest()), strict=True)
        )
        others = [g for g in m.gang_ids if g != peer]
        every = failed_heals(m, peer=peer, joined=others, digests=digests)
        joined = {g.gang_id for g in gangs}
        failed = {g: bad for g, bad in every.items() if g in joined}
        for gid, bad in sorted(every.items()):
            self.job.record(
                HealFailed(
                    at=self.job.now(),
                    step=self.job.step(),
                    gang_id=gid,
                    peer_gang_id=peer,
                    job_ranks=bad,
                )
            )
            if gid not in joined:
                for r in m.gang(gid).job_ranks:
                    self.group.kill(r)
        if not failed:
            return list(gangs)
        dropped = [g for g in gangs if g.gang_id in failed]
        if self.streams.table is None:  # else not booked until the rows are shared out
            # They trained nothing.
            self.job.apply(RanksForgotten(tuple(r for g in dropped for r in g.job_ranks)))
        survivors = [g for g in self.job.view.membership.gang_ids if g not in failed]
        plan = self.job.view.accounting.plan_drop(
            list(failed), survivors, ranks_of=lambda g: self.job.view.membership.gang(g).job_ranks
        )
        self.job.apply(GangsDroppedFromBooks(plan))
        self.job.apply(GangsDropped(tuple(failed)))
        self.job.new_generation(f"gangs {sorted(failed)} did not heal")
        for g in dropped:
            self.placement.release(g.gang_id, g.job_ranks)
        self.request()
        return [g for g in gangs if g.gang_id not in failed]

    def shutdown(self) -> None:
        """Gives back every placement requested and forgets the gangs being built."""
        for pg in self.pending:
            self.group.release(pg)
        self.pending.clear()
        self.building.clear()
        self.shards_of_new.clear()

    def abandon(self, gang: Gang) -> None:
        self.placement.release(gang.gang_id, gang.job_ranks)
        for r in gang.job_ranks:
            self.shards_of_new.pop(r, None)
