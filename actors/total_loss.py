"""The coordinator's recovery from a total loss: rebuild the whole job from a checkpoint.

A total loss leaves some shard with no live copy (every gang lost a rank, or a host under layout
``replicas_within_host``), so re-forming on survivors cannot help.
:func:`~raytrec.elastic.boundary.decide` says what to do: with a checkpoint of this job (a
:class:`~raytrec.elastic.decisions.TotalLoss` naming it) this part kills what is left, releases
every placement group, places a whole job of the initial shape again (waiting up to
``elastic.resource_wait_s``; the pending groups are the demand an autoscaler sees), starts and
builds every gang under fresh gang ids and job ranks, loads the checkpoint into all of them
(resharding as a resume does) and rewinds the step, each rank's data stream and the batch accounting
to it (:func:`~raytrec.elastic.rollback.plan_streams`,
:meth:`~raytrec.elastic.accounting.BatchAccounting.rewound`), then starts a new generation. Without
one the decision is a :class:`~raytrec.elastic.decisions.Fail` saying what would have allowed
recovery.

A part of the job that sees it through :class:`~actors.ports.JobPorts`; what to do is decided by
:func:`~raytrec.elastic.boundary.decide`, and the point it goes back to, the step and the
membership it rebuilds are outcomes (:mod:`actors.job`) the loop applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from actors.job import GangsDropped, GangsJoined, Joining, Rebuilding, Rebuilt, Reserved, Rewound
from actors.nodes import JobNodes
from actors.ports import JobPorts
from actors.reshare import DataStreams
from raytrec.cluster.topology import Topology
from raytrec.elastic.decisions import RollbackPoint, TotalLoss
from raytrec.elastic.events import (
    CheckpointRestored,
    GangDropped,
    GangPlaced,
    GangRequested,
    JobFailed,
)
from raytrec.elastic.events import TotalLoss as TotalLossEvent
from raytrec.elastic.membership import Gang
from raytrec.elastic.workers import RankCallError
from raytrec.errors import JobFailedError

__all__ = ["MAX_REBUILD_ATTEMPTS", "TotalLossRecovery"]

#: Tries at rebuilding when ranks are lost again while the job is being rebuilt.
MAX_REBUILD_ATTEMPTS = 3


class TotalLossRecovery:
    """Rebuilds the job from its checkpoint after a total loss (module doc). ``place_job``:
    places a whole job (:meth:`~actors.gang_placement.JobPlacement.place_job`); ``shutdown``:
    ends every rank and placement; ``request_growth``: asks for the placement the job could
    still add."""

    def __init__(
        self,
        job: JobPorts,
        *,
        topology: Topology,
        streams: DataStreams,
        nodes: JobNodes,
        place_job: Callable[[Sequence[Gang], Callable[[int], Any]], str | None],
        shutdown: Callable[[], None],
        request_growth: Callable[[], None],
    ) -> None:
        self.job = job
        self.topology = topology
        self.streams = streams
        self.nodes = nodes
        self.place_job = place_job
        self.shutdown = shutdown
        self.request_growth = request_growth

    def recover(self, decision: TotalLoss, *, why: Callable[[int], str]) -> None:
        """Some shard may have no live copy left (``decision``): rebuild the job from the
        checkpoint it names. ``why(gang)`` says what happened to a failed gang."""
        failed_gangs = decision.lost_gangs
        dead_shards = decision.lost_shards
        point = decision.point
        assert point is not None, "a total loss to carry out names its checkpoint"
        job = self.job
        for gid in job.view.membership.gang_ids:
            reason = why(gid) if gid in failed_gangs else "the whole job is rebuilt"
            job.record(GangDropped(at=job.now(), step=job.step(), gang_id=gid, reason=reason))
        job.record(
            TotalLossEvent(
                at=job.now(),
                step=job.step(),
                lost_gangs=tuple(failed_gangs),
                dead_shards=dead_shards,
                uri=point.uri,
                checkpoint_step=point.step,
                steps_to_redo=job.step() - point.step,
                reason=decision.reason,
            )
        )
        job.apply(Rebuilding(dataclasses.replace(point, restores=point.restores + 1)))
        error = ""
        for _ in range(MAX_REBUILD_ATTEMPTS):
            self._tear_down()
            try:
                self._rebuild(point)
                return
            except RankCallError as e:  # lost (or stuck) again while rebuilding: start over
                error = f"{type(e).__name__}: {str(e).strip()[:200]}"
        reason = (
            f"rebuilding the job from {point.uri} after a total loss failed "
            f"{MAX_REBUILD_ATTEMPTS} times; last error: {error}"
        )
        job.record(JobFailed(at=job.now(), step=job.step(), reason=reason))
        raise JobFailedError(reason)

    def _tear_down(self) -> None:
        """Kills every rank actor and releases every placement group, pending ones included."""
        self.shutdown()
        self.nodes.forget_all()
        self.job.apply(Joining(frozenset()))
        if self.job.view.membership.gangs:
            self.job.apply(GangsDropped(self.job.view.membership.gang_ids))

    def _rebuild(self, point: RollbackPoint) -> None:
        """A whole job of the initial shape under fresh gang ids and job ranks (their gang
        worlds and replica planes rendezvous under new names), loaded from the checkpoint, with
        its step, data streams and batch accounting rewound to it."""
        job = self.job
        num_gangs, gang_size = self.topology.num_gangs, self.topology.gang_size
        job.record(
            GangRequested(at=job.now(), step=job.step(), count=num_gangs, outstanding=num_gangs)
        )
        gangs, reserved = job.view.membership.reserve([[0] * gang_size] * num_gangs)
        job.apply(Reserved(reserved))
        order = [r for g in gangs for r in g.job_ranks]
        # The checkpoint's model holds exactly the batches committed up to its step: what was
        # committed after it is trained again, so the accounting goes back to that point too.
        job.apply(Rewound(point.step))
        starts = self.streams.rewind_to(
            point.accounting, order=order, gang_ids=[g.gang_id for g in gangs], step=point.step
        )

        def shard_of(rank: int) -> Any:
            return self.streams.shard_of(starts[rank].shard)

        refused = self.place_job(gangs, shard_of)
        if refused is not None:
            reason = (
                f"after a total loss, {refused}; fit(..., resume_from_checkpoint="
                f"{point.uri!r}) resumes from its checkpoint"
            )
            job.record(
                JobFailed(at=job.now(), step=job.step(), reason=reason, needs_checkpoint=True)
            )
            raise JobFailedError(reason)
        gang_of = {r: g.gang_id for g in gangs for r in g.job_ranks}
        self.streams.continue_streams(starts, gang_of=gang_of.__getitem__, step=point.step)
        job.build(order)
        placed = self.nodes.with_nodes(gangs)
        for g in placed:
            job.record(
                GangPlaced(at=job.now(), step=job.step(), nodes=self.nodes.rank_names(g.job_ranks))
            )
        job.apply(GangsJoined(tuple(placed)))
        job.new_generation(f"rebuilt from the checkpoint of step {point.step}")
        loaded = job.call(order, lambda w, r: w.load_checkpoint(point.uri, starts[r].at))
        if not self.streams.reshare(order):  # the saved streams may not be one per rebuilt rank
            self.streams.queue_replays(starts)
        job.apply(Rebuilt(point.step, at=job.clock.monotonic()))
        job.record(
            CheckpointRestored(
                at=job.now(),
                step=job.step(),
                uri=point.uri,
                saved_step=loaded[0]["step"],
                saved_generation=loaded[0]["generation"],
            )
        )
        self.request_growth()
