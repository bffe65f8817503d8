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

A part of the :class:`~actors.coordinator.Coordinator` with state of its own (the point a total loss
goes back to); what to do is decided by :func:`~raytrec.elastic.boundary.decide`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrec.elastic.decisions import RollbackPoint, TotalLoss
from raytrec.elastic.events import (
    CheckpointRestored,
    GangDropped,
    GangPlaced,
    GangRequested,
    JobFailed,
)
from raytrec.elastic.events import TotalLoss as TotalLossEvent
from raytrec.elastic.workers import RankCallError
from raytrec.errors import JobFailedError

if TYPE_CHECKING:
    from actors.coordinator import Coordinator

__all__ = ["MAX_REBUILD_ATTEMPTS", "TotalLossRecovery"]

#: Tries at rebuilding when ranks are lost again while the job is being rebuilt.
MAX_REBUILD_ATTEMPTS = 3


class TotalLossRecovery:
    """Rebuilds the coordinator's job from its checkpoint after a total loss (module doc). Owns
    the point a total loss goes back to (the last checkpoint saved or resumed from)."""

    def __init__(self, job: Coordinator) -> None:
        self.job = job
        self.point: RollbackPoint | None = None

    def recover(self, decision: TotalLoss, *, why: Callable[[int], str]) -> None:
        """Some shard may have no live copy left (``decision``): rebuild the job from the
        checkpoint it names. ``why(gang)`` says what happened to a failed gang."""
        failed_gangs = decision.lost_gangs
        dead_shards = decision.lost_shards
        point = decision.point
        assert point is not None, "a total loss to carry out names its checkpoint"
        for gid in self.job.membership.gang_ids:
            reason = why(gid) if gid in failed_gangs else "the whole job is rebuilt"
            self.job.events.append(
                GangDropped(at=self.job._now(), step=self.job.step, gang_id=gid, reason=reason)
            )
        self.job.events.append(
            TotalLossEvent(
                at=self.job._now(),
                step=self.job.step,
                lost_gangs=tuple(failed_gangs),
                dead_shards=dead_shards,
                uri=point.uri,
                checkpoint_step=point.step,
                steps_to_redo=self.job.step - point.step,
                reason=decision.reason,
            )
        )
        self.point = dataclasses.replace(point, restores=point.restores + 1)
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
        self.job.events.append(JobFailed(at=self.job._now(), step=self.job.step, reason=reason))
        raise JobFailedError(reason)

    def _tear_down(self) -> None:
        """Kills every rank actor and releases every placement group, pending ones included."""
        self.job.shutdown()
        self.job.nodes.of_rank.clear()
        self.job.growth.joining = set()
        if self.job.membership.gangs:
            self.job.membership = self.job.membership.without(self.job.membership.gang_ids)

    def _rebuild(self, point: RollbackPoint) -> None:
        """A whole job of the initial shape under fresh gang ids and job ranks (their gang
        worlds and replica planes rendezvous under new names), loaded from the checkpoint, with
        its step, data streams and batch accounting rewound to it."""
        num_gangs, gang_size = self.job.topology.num_gangs, self.job.topology.gang_size
        self.job.events.append(
            GangRequested(
                at=self.job._now(), step=self.job.step, count=num_gangs, outstanding=num_gangs
            )
        )
        gangs, self.job.membership = self.job.membership.reserve([[0] * gang_size] * num_gangs)
        order = [r for g in gangs for r in g.job_ranks]
        # The checkpoint's model holds exactly the batches committed up to its step: what was
        # committed after it is trained again, so the accounting goes back to that point too.
        self.job.step = point.step
        starts = self.job.streams.rewind_to(
            point.accounting, order=order, gang_ids=[g.gang_id for g in gangs], step=point.step
        )

        def shard_of(rank: int) -> Any:
            return self.job.streams.shard_of(starts[rank].shard)

        refused = self.job.placement.place_job(gangs, shard_of)
        if refused is not None:
            reason = (
                f"after a total loss, {refused}; fit(..., resume_from_checkpoint="
                f"{point.uri!r}) resumes from its checkpoint"
            )
            self.job.events.append(
                JobFailed(
                    at=self.job._now(), step=self.job.step, reason=reason, needs_checkpoint=True
                )
            )
            raise JobFailedError(reason)
        gang_of = {r: g.gang_id for g in gangs for r in g.job_ranks}
        self.job.streams.continue_streams(starts, gang_of=gang_of.__getitem__, step=point.step)
        self.job._build(order)
        placed = self.job.nodes.with_nodes(gangs)
        for g in placed:
            nodes = self.job.nodes.rank_names(g.job_ranks)
            self.job.events.append(GangPlaced(at=self.job._now(), step=self.job.step, nodes=nodes))
        self.job.membership = self.job.membership.with_gangs(placed, step=point.step)
        self.job._new_generation(reason=f"rebuilt from the checkpoint of step {point.step}")
        loaded = self.job._call(order, lambda w, r: w.load_checkpoint(point.uri, starts[r].at))
        if not self.job.streams.reshare(order):  # the saved streams may not be one per rebuilt rank
            self.job.streams.queue_replays(starts)
        self.job.checkpoints.last_save = (point.step, self.job.clock.monotonic())
        self.job.events.append(
            CheckpointRestored(
                at=self.job._now(),
                step=self.job.step,
                uri=point.uri,
                saved_step=loaded[0]["step"],
                saved_generation=loaded[0]["generation"],
            )
        )
        self.job.growth.request()
