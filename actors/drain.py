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
from typing import TYPE_CHECKING

from raytrec.elastic.decisions import Drain
from raytrec.elastic.drain_policy import REQUEST_FILE, DrainRequest, read_request
from raytrec.elastic.events import DrainRejected, GangDrained
from raytrec.errors import ConfigError

if TYPE_CHECKING:
    from actors.coordinator import Coordinator

__all__ = ["GangDrain"]


class GangDrain:
    """Carries out drains at interval boundaries (module doc)."""

    def __init__(self, job: Coordinator) -> None:
        self.job = job

    def request(self, *, take: bool) -> DrainRequest:
        """What is asked now: a user's request in the run directory and the nodes the cluster
        is draining. ``take``: a user's request is consumed (it is being carried out)."""
        path = os.path.join(self.job.run_dir, REQUEST_FILE)
        try:
            request = read_request(path, remove=take)
        except ConfigError as e:  # a bad request must not stop a training job
            os.replace(path, f"{path}.rejected")
            self.job.events.append(
                DrainRejected(at=self.job._now(), step=self.job.step, reason=str(e))
            )
            request = DrainRequest()
        draining = self.job.group.draining_nodes()
        if draining:
            request = request.merged(DrainRequest(nodes=frozenset(draining)))
        return request

    def apply(self, decision: Drain) -> None:
        """Gives gangs back at this boundary (nothing in flight), as ``decision`` says: a
        job-wide sync commits their work, the rows they had not trained are shared again among
        the others, and their placement groups are released; no row is lost or trained twice."""
        self.job.max_gangs = decision.max_gangs
        if decision.gangs:
            self.job._call(self.job._live_ranks(), lambda w, _r: w.sync())
            self.job._commit_all()
            drained = list(decision.gangs)
            survivors = [g for g in self.job.membership.gang_ids if g not in decision.gangs]
            ranks = [r for g in drained for r in self.job.membership.gang(g).job_ranks]
            # They reported every batch up to this step and all of it is committed: this only
            # retires their streams where they stand, for the others or a later gang to go on.
            self.job.accounting.lost_rank_reports(ranks, fail_step=self.job.step)
            # Replays queued for them and not read yet go to the others.
            replay = self.job.recovery.drop(drained, survivors)
            for gid in drained:
                self.job.events.append(
                    GangDrained(
                        at=self.job._now(), step=self.job.step, gang_id=gid, reason=decision.reason
                    )
                )
                self.job.placement.kill_gang(gid)
            self.job.membership = self.job.membership.without(drained)
        # Placement requested beyond the new cap is given back too.
        while (
            self.job.growth.pending
            and self.job.membership.num_gangs
            + len(self.job.growth.pending)
            + len(self.job.growth.building)
            > self.job.max_gangs
        ):
            self.job.group.release(self.job.growth.pending.pop())
        if decision.gangs:
            self.job._new_generation(reason=decision.reason)
            if self.job.streams.reshare(self.job._ranks_in_gang_order()):
                self.job._ready = 0  # new streams: every rank reads its share from the start
            elif replay:
                acc = self.job.accounting
                self.job._call(
                    sorted(replay), lambda w, r: w.replay(replay[r], acc.embedding_only(replay[r]))
                )
                self.job._ready = 0  # the replays come before what they had prepared
                self.job.make_room_for_replays()
        self.job.growth.request()
