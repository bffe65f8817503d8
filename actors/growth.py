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

A part of the :class:`~actors.coordinator.Coordinator` with state of its own (the placements
requested, the gangs being built and joining); it carries out the
:class:`~raytrec.elastic.decisions.Grow` that :func:`~raytrec.elastic.boundary.decide` returns
for the gangs built, and asks :func:`~raytrec.elastic.control.gangs_to_request` how much to keep
pending and :func:`~raytrec.elastic.heal.failed_heals` whether each healed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from actors.job import Committed, Joining
from raytrec.cluster.placement import placement_specs, rank_resources
from raytrec.cluster.topology import Layout
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
from raytrec.elastic.report import RankInfo
from raytrec.elastic.workers import Placement, RankCallError

if TYPE_CHECKING:
    from actors.coordinator import Coordinator

__all__ = ["Building", "GangGrowth"]


@dataclasses.dataclass
class Building:
    """A gang started in the background: its reserved slots and each rank's ``build`` call."""

    gang: Gang
    builds: dict[int, Any]  # job rank -> the future of its build()


class GangGrowth:
    """Grows the coordinator's job by whole gangs (module doc). Owns the placements requested
    for gangs not started yet, the gangs being built and the gangs joining; reads and changes
    the job (membership, accounting, events) through the coordinator it is part of."""

    def __init__(self, job: Coordinator) -> None:
        self.job = job
        self.pending: list[Placement] = []  # requested for gangs not started yet
        self.building: dict[int, Building] = {}  # gang id -> a new gang being built
        self.shards_of_new: dict[int, Any] = {}  # job rank -> its data shard, until it joins

    def request(self) -> None:
        """Keeps one pending placement group per gang the job could still add
        (:func:`~raytrec.elastic.control.gangs_to_request`)."""
        job = self.job
        if job.topology.layout is not Layout.REPLICAS_ACROSS_HOSTS or job.new_shard is None:
            return  # one placement group for the whole job, or no data for a new gang
        want = gangs_to_request(
            live=job.state.membership.num_gangs,
            outstanding=len(self.pending) + len(self.building),
            max_gangs=job.state.max_gangs,
            min_gangs=job.elastic.min_gangs,
            grow=job.elastic.grow,
        )
        if want <= 0:
            return
        per_rank = rank_resources(
            cpus_per_rank=self.job.cfg.scaling.cpus_per_rank, use_gpu=self.job.cfg.scaling.use_gpu
        )
        spec = placement_specs(self.job.topology, per_rank=per_rank, gangs=(0,))[0]
        for _ in range(want):
            self.pending.append(self.job.group.place(spec))
        self.job.events.append(
            GangRequested(
                at=self.job._now(),
                step=self.job.state.step,
                count=want,
                outstanding=len(self.pending),
            )
        )

    def fit_to_cap(self) -> None:
        """Gives back the placement requested beyond the job's gang cap."""
        while (
            self.pending
            and self.job.state.membership.num_gangs + len(self.pending) + len(self.building)
            > self.job.state.max_gangs
        ):
            self.job.group.release(self.pending.pop())

    def start_ready(self) -> None:
        """Starts building the gangs whose placement became ready. Building a gang (its ranks'
        imports, gang world and sharded model: seconds) runs in the background while the live
        gangs train; they pause only for the join itself (:meth:`join`), at an interval
        boundary, once every rank of the new gang is built."""
        self._start_ready()

    def _start_ready(self) -> None:
        if not self.pending:
            return
        ready = self.job.group.ready(self.pending, timeout=0)
        if not ready:
            return
        self.pending = [pg for pg in self.pending if pg not in ready]
        gangs, self.job.state.membership = self.job.state.membership.reserve(
            [[0] * self.job.topology.gang_size for _ in ready]  # nodes filled in once built
        )
        for gang, pg in zip(gangs, ready, strict=True):
            self.job.placement.pgs[gang.gang_id] = pg
            for slot in gang.ranks:
                shard = self.job.new_shard(slot.job_rank)
                self.job.placement.start_rank(
                    slot.job_rank, gang.gang_id, slot.gang_rank, pg, 0, shard, account=False
                )
            builds = self.job.group.call(gang.job_ranks, lambda w, _r: w.build())
            self.building[gang.gang_id] = Building(gang=gang, builds=builds)

    def built(self) -> list[Building]:
        """The gangs whose every rank is built, taken out of :attr:`building` to join; drops
        (and asks again for) a gang that lost a rank while building."""
        built: list[Building] = []
        for gid, b in list(self.building.items()):
            futures = list(b.builds.values())
            done = self.job.group.wait(futures, num_returns=len(futures), timeout=0)
            failed = False
            for future in done:
                try:
                    self.job.group.result(future)
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
            infos: list[RankInfo] = [self.job.group.result(f) for f in b.builds.values()]
            for info in infos:
                self.job.nodes.saw(info)
            new_ranks += b.gang.job_ranks
            nodes = self.job.nodes.rank_names(b.gang.job_ranks)
            self.job.events.append(
                GangPlaced(at=self.job._now(), step=self.job.state.step, nodes=nodes)
            )
        # Join at a sync boundary: the live gangs agree first, so the peer's state is the job's.
        try:
            self.job._call(self.job._live_ranks(), lambda w, _r: w.sync())
        except RankCallError:
            # A survivor failed: recovery takes over; the new gangs, not members yet, are let
            # go (their placement is requested again once the job has re-formed).
            for b in built:
                self.abandon(b.gang)
            raise
        self.job.apply(Committed())
        peer = decision.gangs[0].heal_from
        gangs = self.job.nodes.with_nodes([b.gang for b in built])
        reshare = self.job.streams.table is not None
        for r in new_ranks:  # they train from this step on
            shard = self.shards_of_new.pop(r)
            if not reshare:  # else booked with the share they are given below
                self.job.state.accounting.add_rank(
                    r, shard=getattr(shard, "index", r), step=self.job.state.step
                )
        self.job.state.membership = self.job.state.membership.with_gangs(
            gangs, step=self.job.state.step
        )
        self.job.apply(Joining(frozenset(g.gang_id for g in gangs)))
        self.job.state.accounting.add_gangs(g.gang_id for g in gangs)
        self.job._new_generation(reason=f"gangs {[g.gang_id for g in gangs]} joined")
        step = self.job.state.step
        self.job._call(new_ranks, lambda w, _r: w.set_step(step))
        src = self.job.state.membership.member_index(peer)
        self.job._call(self.job._live_ranks(), lambda w, _r: w.broadcast_state(src))
        gangs = tuple(self._verify_heals(gangs, peer=peer))
        new_ranks = [r for g in gangs for r in g.job_ranks]
        fresh = self.job.streams.reshare(self.job._ranks_in_gang_order(), joining=new_ranks)
        self.job.apply(Joining(frozenset()))
        for g in gangs:
            self.job.events.append(
                GangHealed(
                    at=self.job._now(),
                    step=self.job.state.step,
                    gang_id=g.gang_id,
                    peer_gang_id=peer,
                )
            )
            self.job.events.append(
                GangJoined(
                    at=self.job._now(),
                    step=self.job.state.step,
                    gang_id=g.gang_id,
                    generation=self.job.state.membership.generation,
                )
            )
        # Ranks given a new stream have nothing read yet (the others read ahead already).
        ready = fresh if reshare else new_ranks
        n = min(self.job.cfg.log_every, self.job.state.end_step - self.job.state.step)
        self.job._call(ready, lambda w, _r: w.prepare(n))
        # Every rank holds n now when all were given a new stream; else the others hold what
        # they held (nothing, right after a recovery: they prepare before the next interval).
        everyone = set(ready) >= set(self.job._live_ranks())
        self.job.state.ready = n if everyone else min(self.job.state.ready, n)

    def _verify_heals(self, gangs: Sequence[Gang], *, peer: int) -> list[Gang]:
        """Compares each joined gang's state with the peer it healed from, before any
        averaging (:func:`~raytrec.elastic.heal.failed_heals`); a gang that differs is dropped
        (a new generation without it), released and placed again. Returns the gangs that
        healed."""
        ranks = [
            *self.job.state.membership.gang(peer).job_ranks,
            *(r for g in gangs for r in g.job_ranks),
        ]
        digests = dict(
            zip(ranks, self.job._call(ranks, lambda w, _r: w.state_digest()), strict=True)
        )
        failed = failed_heals(
            self.job.state.membership, peer=peer, joined=[g.gang_id for g in gangs], digests=digests
        )
        if not failed:
            return list(gangs)
        for gid, bad in sorted(failed.items()):
            self.job.events.append(
                HealFailed(
                    at=self.job._now(),
                    step=self.job.state.step,
                    gang_id=gid,
                    peer_gang_id=peer,
                    job_ranks=bad,
                )
            )
        dropped = [g for g in gangs if g.gang_id in failed]
        if self.job.streams.table is None:  # else not booked until the rows are shared out
            for g in dropped:
                for r in g.job_ranks:
                    self.job.state.accounting.forget_rank(r)  # it trained nothing
        survivors = [g for g in self.job.state.membership.gang_ids if g not in failed]
        self.job.state.accounting.drop(
            list(failed), survivors, ranks_of=lambda g: self.job.state.membership.gang(g).job_ranks
        )
        self.job.state.membership = self.job.state.membership.without(failed)
        self.job._new_generation(reason=f"gangs {sorted(failed)} did not heal")
        for g in dropped:
            self.job.placement.release(g.gang_id, g.job_ranks)
        self.request()
        return [g for g in gangs if g.gang_id not in failed]

    def abandon(self, gang: Gang) -> None:
        self.job.placement.release(gang.gang_id, gang.job_ranks)
        for r in gang.job_ranks:
            self.shards_of_new.pop(r, None)
