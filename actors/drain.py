"""Giving gangs back on purpose: the coordinator's part that carries out a drain.

:class:`GangDrain` reads what is asked (a user's request in the run directory,
:func:`raytrec.drain`; nodes the cluster marks as draining) for
:func:`~raytrec.elastic.boundary.decide`, and carries out the
:class:`~raytrec.elastic.decisions.Drain` it returns at an interval boundary: a job-wide sync
commits every gang's work, the drained gangs' streams are retired where they stand and the rows
left are shared again among the others, their placement groups are released, and a new
generation starts. No row is lost or trained twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

from actors.job import (
    CapChanged,
    Committed,
    GangsDropped,
    GangsDroppedFromBooks,
    Prepared,
    RanksLost,
)
from actors.ports import GenerationPorts
from actors.reshare import DataStreams
from raytrec.elastic.decisions import Drain
from raytrec.elastic.drain_policy import REQUEST_FILE, DrainRequest, read_request
from raytrec.elastic.events import DrainRejected, GangDrained, StragglerEvicted
from raytrec.errors import ConfigError

__all__ = ["GangDrain"]


class GangDrain:
    """Carries out drains at interval boundaries (module doc). Sees the job through ``job``;
    ``draining_nodes``: the nodes the cluster is draining; ``kill_gang``: ends a gang's ranks
    and placement (``evicted=True``: a straggler's); ``fit_growth``: gives back placement
    requested beyond the job's gang cap;
    ``request_growth``: asks for the placement the job could still add."""

    def __init__(
        self,
        job: GenerationPorts,
        *,
        run_dir: str,
        streams: DataStreams,
        draining_nodes: Callable[[], Collection[str]],
        kill_gang: Callable[..., None],
        fit_growth: Callable[[], None],
        request_growth: Callable[[], None],
    ) -> None:
        self.job = job
        self.run_dir = run_dir
        self.streams = streams
        self.draining_nodes = draining_nodes
        self.kill_gang = kill_gang
        self.fit_growth = fit_growth
        self.request_growth = request_growth

    def request(self, *, take: bool) -> DrainRequest:
        """What is asked now: a user's request in the run directory and the nodes the cluster
        is draining. ``take``: a user's request is consumed (it is being carried out)."""
        path = os.path.join(self.run_dir, REQUEST_FILE)
        try:
            request = read_request(path, remove=take)
        except ConfigError as e:  # a bad request must not stop a training job
            os.replace(path, f"{path}.rejected")
            self.job.record(DrainRejected(at=self.job.now(), step=self.job.step(), reason=str(e)))
            request = DrainRequest()
        draining = self.draining_nodes()
        if draining:
            request = request.merged(DrainRequest(nodes=frozenset(draining)))
        return request

    def apply(self, decision: Drain) -> None:
        """Gives gangs back at this boundary (nothing in flight), as ``decision`` says: a
        job-wide sync commits their work, the rows they had not trained are shared again among
        the others, and their placement groups are released; no row is lost or trained twice."""
        job = self.job
        job.apply(CapChanged(decision.max_gangs))
        replay: dict[int, list[int]] = {}
        if decision.gangs:
            job.call(job.live_ranks(), lambda w, _r: w.sync())
            job.apply(Committed())
            drained = list(decision.gangs)
            m, acc = job.view.membership, job.view.accounting
            survivors = [g for g in m.gang_ids if g not in decision.gangs]
            ranks = [r for g in drained for r in m.gang(g).job_ranks]
            # They reported every batch up to this step and all of it is committed: this only
            # retires their streams where they stand, for the others or a later gang to go on.
            job.apply(RanksLost(tuple(acc.reports_of_lost(ranks, fail_step=job.step()))))
            # Replays queued for them and not read yet go to the others.
            plan = acc.plan_drop(drained, survivors, ranks_of=lambda g: m.gang(g).job_ranks)
            job.apply(GangsDroppedFromBooks(plan))
            replay = plan.replays
            if (slow := decision.straggler) is not None:
                job.record(
                    StragglerEvicted(
                        at=job.now(),
                        step=job.step(),
                        gang_id=slow.gang,
                        step_s=slow.step_s,
                        others_s=slow.others_s,
                        intervals=slow.intervals,
                    )
                )
            for gid in drained:
                job.record(
                    GangDrained(at=job.now(), step=job.step(), gang_id=gid, reason=decision.reason)
                )
                # A straggler's replacement goes to another failure domain where there is room.
                self.kill_gang(gid, evicted=slow is not None and gid == slow.gang)
            job.apply(GangsDropped(tuple(drained)))
        # Placement requested beyond the new cap is given back too.
        self.fit_growth()
        if decision.gangs:
            job.new_generation(decision.reason)
            if self.streams.reshare(job.ranks_in_gang_order()):
                job.apply(Prepared(0))  # new streams: every rank reads its share from the start
            elif replay:
                acc = job.view.accounting
                job.call(
                    sorted(replay), lambda w, r: w.replay(replay[r], acc.embedding_only(replay[r]))
                )
                job.apply(Prepared(0))  # the replays come before what they had prepared
                self.streams.make_room_for_replays()
        self.request_growth()
