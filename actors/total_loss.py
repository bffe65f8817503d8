"""The coordinator's recovery from a total loss: rebuild the whole job from a checkpoint.

A total loss leaves some shard with no live copy (every gang lost a rank, or a host under layout
``replicas_within_host``), so re-forming on survivors cannot help.
:func:`~raytrec.elastic.boundary.decide` says what to do: with a checkpoint of this job (a
:class:`~raytrec.elastic.decisions.TotalLoss` naming it) this part kills what is left, releases
every placement group, places a whole job of the initial shape again, or as many of its gangs as
the cluster's live nodes hold, down to ``elastic.min_gangs`` (waiting up to
``elastic.resource_wait_s``; the pending groups are the demand an autoscaler sees), starts and
builds every gang under fresh gang ids and job ranks, loads the checkpoint into all of them
(resharding as a resume does) and rewinds the step, each rank's data stream and the batch accounting
to it (:func:`~raytrec.elastic.rollback.plan_streams`,
:meth:`~raytrec.elastic.accounting.BatchAccounting.rewound`), then starts a new generation. Without
one the decision is a :class:`~raytrec.elastic.decisions.Fail` saying what would have allowed
recovery.

A part of the job that sees it through :class:`TotalLossPorts`; what to do is decided by
:func:`~raytrec.elastic.boundary.decide`, and the point it goes back to, the step and the
membership it rebuilds are outcomes (:mod:`actors.job`) the loop applies. The loop
(:mod:`actors.job_loop`, state ``Rebuilding``) waits for the placement between :meth:`rebuild`
and :meth:`placed`, and starts over when a rank is lost meanwhile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from actors.gang_placement import PendingJob
from actors.job import GangsDropped, GangsJoined, Joining, Rebuilding, Rebuilt, Reserved, Rewound
from actors.nodes import JobNodes
from actors.ports import (
    HasBuild,
    HasCall,
    HasClock,
    HasEvents,
    HasNewGeneration,
    HasShared,
    HasStep,
)
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
from raytrec.elastic.rollback import StreamStart
from raytrec.errors import JobFailedError

__all__ = ["MAX_REBUILD_ATTEMPTS", "PendingRebuild", "TotalLossPorts", "TotalLossRecovery"]

#: Tries at rebuilding when ranks are lost again while the job is being rebuilt.
MAX_REBUILD_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingRebuild:
    """A rebuild waiting for its placement: the gangs, each rank's stream, the placement."""

    point: RollbackPoint
    gangs: tuple[Gang, ...]
    starts: Mapping[int, StreamStart]
    job: PendingJob


class TotalLossPorts(
    HasCall, HasStep, HasEvents, HasClock, HasShared, HasBuild, HasNewGeneration, Protocol
):
    """The ports :class:`TotalLossRecovery` calls."""


class TotalLossRecovery:
    """Rebuilds the job from its checkpoint after a total loss (module doc). ``request_job``:
    asks for a whole job's placement (:meth:`~actors.gang_placement.JobPlacement.request_job`);
    ``shutdown``:
    ends every rank and placement; ``request_growth``: asks for the placement the job could
    still add."""

    def __init__(
        self,
        job: TotalLossPorts,
        *,
        topology: Topology,
        streams: DataStreams,
        nodes: JobNodes,
        request_job: Callable[[Sequence[Gang], Callable[[int], Any]], PendingJob],
        gangs_to_place: Callable[[], int],
        shutdown: Callable[[], None],
        request_growth: Callable[[], None],
    ) -> None:
        self.job = job
        self.topology = topology
        self.streams = streams
        self.nodes = nodes
        self.request_job = request_job
        self.gangs_to_place = gangs_to_place
        self.shutdown = shutdown
        self.request_growth = request_growth

    def begin(self, decision: TotalLoss, *, why: Callable[[int], str]) -> None:
        """Some shard may have no live copy left (``decision``): records the loss and the
        rebuild from the checkpoint it names. ``why(gang)`` says what happened to a failed
        gang."""
        failed_gangs = decision.lost_gangs
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
                dead_shards=decision.lost_shards,
                uri=point.uri,
                checkpoint_step=point.step,
                steps_to_redo=job.step() - point.step,
                reason=decision.reason,
            )
        )
        job.apply(Rebuilding(dataclasses.replace(point, restores=point.restores + 1)))

    def rebuild(self) -> PendingRebuild:
        """Ends what is left of the job and starts rebuilding it from the rollback point: the
        placement groups of a whole job asked for (the loop waits for them, then
        :meth:`placed`)."""
        point = self.job.view.point
        assert point is not None, "a rebuild goes back to the job's rollback point"
        self._tear_down()
        return self._rebuild(point)

    def give_up(self, error: str) -> JobFailedError:
        """The job failed: rebuilding kept losing ranks (``error``: the last time's)."""
        point = self.job.view.point
        assert point is not None
        reason = (
            f"rebuilding the job from {point.uri} after a total loss failed "
            f"{MAX_REBUILD_ATTEMPTS} times; last error: {error}"
        )
        self.job.record(JobFailed(at=self.job.now(), step=self.job.step(), reason=reason))
        return JobFailedError(reason)

    def _tear_down(self) -> None:
        """Kills every rank actor and releases every placement group, pending ones included."""
        self.shutdown()
        self.nodes.forget_all()
        self.job.apply(Joining(frozenset()))
        if self.job.view.membership.gangs:
            self.job.apply(GangsDropped(self.job.view.membership.gang_ids))

    def _rebuild(self, point: RollbackPoint) -> PendingRebuild:
        """A whole job of the initial shape, or of as many gangs as the cluster holds now
        (``gangs_to_place``), under fresh gang ids and job ranks (their gang worlds and replica
        planes rendezvous under new names), its step, data streams and batch accounting rewound
        to the checkpoint, its placement asked for."""
        job = self.job
        num_gangs, gang_size = self.gangs_to_place(), self.topology.gang_size
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

        return PendingRebuild(
            point=point,
            gangs=tuple(gangs),
            starts=starts,
            job=self.request_job(gangs, shard_of),
        )

    def refused(self, why: str) -> JobFailedError:
        """The rebuilt job's placement was refused (``why``): the job fails, saying how to
        resume it from its checkpoint."""
        point, job = self.job.view.point, self.job
        assert point is not None
        reason = (
            f"after a total loss, {why}; fit(..., resume_from_checkpoint="
            f"{point.uri!r}) resumes from its checkpoint"
        )
        job.record(JobFailed(at=job.now(), step=job.step(), reason=reason, needs_checkpoint=True))
        return JobFailedError(reason)

    def placed(self, rebuild: PendingRebuild) -> None:
        """The rebuilt job's ranks are started: builds them, forms a generation, loads the
        checkpoint into every rank and hands each its stream."""
        job, point, gangs, starts = self.job, rebuild.point, rebuild.gangs, rebuild.starts
        order = [r for g in gangs for r in g.job_ranks]
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
