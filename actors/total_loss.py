"""The coordinator's recovery from a total loss: rebuild the whole job from a checkpoint.

A total loss leaves some shard with no live copy (every gang lost a rank, or a host under layout
``replicas_within_host``), so re-forming on survivors cannot help. The coordinator asks
:func:`~raytrec.elastic.rollback.decide_total_loss` what to do. With a checkpoint of this job
it kills what is left, releases every placement group, places a whole job of the initial shape
again (waiting up to ``elastic.resource_wait_s``; the pending groups are the demand an
autoscaler sees), starts and builds every gang under fresh gang ids and job ranks, loads the
checkpoint into all of them (resharding as a resume does) and rewinds the step, each rank's data
stream and the batch accounting to it (:func:`~raytrec.elastic.rollback.plan_streams`,
:meth:`~raytrec.elastic.accounting.BatchAccounting.rewound`), then starts a new generation.
Without one the job fails, saying what would have allowed recovery.

A mixin of :class:`~actors.coordinator.Coordinator`, which provides the state and the methods
declared in the class body; it lives here to keep the coordinator's module to its control loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from actors.rank import RankWorker
from raytrec.config import TrainConfig
from raytrec.data.source import BatchShard
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import (
    CheckpointRestored,
    EventLog,
    GangDropped,
    GangPlaced,
    GangRequested,
    JobFailed,
    TotalLoss,
)
from raytrec.elastic.membership import Gang, Membership
from raytrec.elastic.report import RankInfo
from raytrec.elastic.rollback import (
    GiveUp,
    Rebuild,
    RollbackPoint,
    StreamStart,
    decide_total_loss,
    describe_total_loss,
    plan_streams,
)
from raytrec.elastic.workers import Clock, RankCallError
from raytrec.errors import JobFailedError
from raytrec.topology import Layout, Topology

__all__ = ["MAX_REBUILD_ATTEMPTS", "TotalLossRecovery"]

#: Tries at rebuilding when ranks are lost again while the job is being rebuilt.
MAX_REBUILD_ATTEMPTS = 3


class TotalLossRecovery:
    """Rebuilds the coordinator's job from its checkpoint after a total loss (module doc)."""

    # Provided by the coordinator.
    cfg: TrainConfig
    topology: Topology
    elastic: ElasticConfig
    membership: Membership
    accounting: BatchAccounting
    events: EventLog
    step: int
    shards: list[BatchShard]
    new_shard: Any  # shard index -> BatchShard, or None
    streams_table: Any  # StreamTable of a re-shared source, or None
    _rollback: RollbackPoint | None
    _stream_id: Callable[[int, int], int] | None
    _last_save: tuple[int, float]
    _rank_nodes: dict[int, str]
    _joining: set[int]
    clock: Clock

    if TYPE_CHECKING:

        def _now(self) -> float: ...
        def _place_job(
            self, gangs: Sequence[Gang], shard_of: Callable[[int], Any], *, timeout_s: float
        ) -> bool: ...
        def _build(self, ranks: list[int]) -> list[RankInfo]: ...
        def _with_nodes(self, gangs: Sequence[Gang]) -> tuple[Gang, ...]: ...
        def _new_generation(self, *, reason: str) -> None: ...
        def _call_by_rank(
            self,
            ranks: list[int],
            method: Callable[..., Any],
            args_of: Callable[[int], tuple[Any, ...]],
            **kwargs: Any,
        ) -> list[Any]: ...
        def _request_growth(self) -> None: ...
        def _reshare_rows(self, ranks: Sequence[int], *, joining: Sequence[int] = ()) -> bool: ...
        def shutdown(self) -> None: ...

    def _total_loss(
        self, lost: list[int], failed_gangs: list[int], *, why: Callable[[int], str]
    ) -> None:
        """``lost`` ranks failed (not counting gang peers the coordinator killed), breaking
        ``failed_gangs``, and some shard may have no live copy left: rebuild the job from its
        checkpoint, or fail saying what would have allowed recovery. ``why(gang)`` says what
        happened to a failed gang."""
        dead_shards = self.membership.dead_shards(lost)
        loss = describe_total_loss(
            within_host=self.topology.layout is Layout.REPLICAS_WITHIN_HOST,
            lost_ranks=lost,
            failed_gangs=failed_gangs,
            dead_shards=dead_shards,
        )
        decision = decide_total_loss(
            loss=loss,
            point=self._rollback,
            restore=self.elastic.restore_on_total_loss,
            checkpoint=self.cfg.checkpoint,
            replayable=self._stream_id is not None,
            step=self.step,
        )
        if isinstance(decision, GiveUp):
            self.events.append(
                JobFailed(
                    at=self._now(), step=self.step, reason=decision.reason, needs_checkpoint=True
                )
            )
            raise JobFailedError(decision.reason)
        for gid in self.membership.gang_ids:
            reason = why(gid) if gid in failed_gangs else "the whole job is rebuilt"
            self.events.append(
                GangDropped(at=self._now(), step=self.step, gang_id=gid, reason=reason)
            )
        point = decision.point
        self.events.append(
            TotalLoss(
                at=self._now(),
                step=self.step,
                lost_gangs=tuple(failed_gangs),
                dead_shards=dead_shards,
                uri=point.uri,
                checkpoint_step=point.step,
                steps_to_redo=self.step - point.step,
                reason=decision.reason,
            )
        )
        self._rollback = dataclasses.replace(point, restores=point.restores + 1)
        error = ""
        for _ in range(MAX_REBUILD_ATTEMPTS):
            self._tear_down()
            try:
                self._rebuild(decision)
                return
            except (RankCallError, TimeoutError) as e:  # lost again while rebuilding: start over
                error = f"{type(e).__name__}: {str(e).strip()[:200]}"
        reason = (
            f"rebuilding the job from {point.uri} after a total loss failed "
            f"{MAX_REBUILD_ATTEMPTS} times; last error: {error}"
        )
        self.events.append(JobFailed(at=self._now(), step=self.step, reason=reason))
        raise JobFailedError(reason)

    def _tear_down(self) -> None:
        """Kills every rank actor and releases every placement group, pending ones included."""
        self.shutdown()
        self._rank_nodes.clear()
        self._joining = set()
        if self.membership.gangs:
            self.membership = self.membership.without(self.membership.gang_ids)

    def _rebuild(self, decision: Rebuild) -> None:
        """A whole job of the initial shape under fresh gang ids and job ranks (their gang
        worlds and replica planes rendezvous under new names), loaded from the checkpoint, with
        its step, data streams and batch accounting rewound to it."""
        point = decision.point
        num_gangs, gang_size = self.topology.num_gangs, self.topology.gang_size
        self.events.append(
            GangRequested(at=self._now(), step=self.step, count=num_gangs, outstanding=num_gangs)
        )
        gangs, self.membership = self.membership.reserve([[0] * gang_size] * num_gangs)
        order = [r for g in gangs for r in g.job_ranks]
        # The checkpoint's model holds exactly the batches committed up to its step: what was
        # committed after it is trained again, so the accounting goes back to that point too.
        self.step = point.step
        starts = self._rewind_to(
            point.accounting, order=order, gang_ids=[g.gang_id for g in gangs], step=point.step
        )

        def shard_of(rank: int) -> Any:
            return self._shard_of(starts[rank].shard)

        if not self._place_job(gangs, shard_of, timeout_s=self.elastic.resource_wait_s):
            reason = (
                f"after a total loss, no placement for the whole job ({num_gangs} gangs x "
                f"{gang_size} ranks) came within elastic.resource_wait_s="
                f"{self.elastic.resource_wait_s:g}s; fit(..., resume_from_checkpoint="
                f"{point.uri!r}) resumes from its checkpoint"
            )
            self.events.append(
                JobFailed(at=self._now(), step=self.step, reason=reason, needs_checkpoint=True)
            )
            raise JobFailedError(reason)
        gang_of = {r: g.gang_id for g in gangs for r in g.job_ranks}
        self._continue_streams(starts, gang_of=gang_of.__getitem__, step=point.step)
        self._build(order)
        placed = self._with_nodes(gangs)
        for g in placed:
            nodes = tuple(slot.node for slot in g.ranks)
            self.events.append(GangPlaced(at=self._now(), step=self.step, nodes=nodes))
        self.membership = self.membership.with_gangs(placed, step=point.step)
        self._new_generation(reason=f"rebuilt from the checkpoint of step {point.step}")
        loaded = self._call_by_rank(
            order, RankWorker.load_checkpoint, lambda r: (point.uri, starts[r].at)
        )
        if not self._reshare_rows(order):  # the saved streams may not be one per rebuilt rank
            self._queue_replays(starts)
        self._last_save = (point.step, self.clock.monotonic())
        self.events.append(
            CheckpointRestored(
                at=self._now(),
                step=self.step,
                uri=point.uri,
                saved_step=loaded[0]["step"],
                saved_generation=loaded[0]["generation"],
            )
        )
        self._request_growth()

    def _rewind_to(
        self,
        snapshot: Mapping[str, Any],
        *,
        order: Sequence[int],
        gang_ids: Sequence[int],
        step: int,
    ) -> dict[int, StreamStart]:
        """The batch accounting back to ``snapshot`` (a checkpoint's) for gangs ``gang_ids``, and
        where each rank of ``order`` (gang order) reads from there on; add the ranks with
        ``add_rank`` (placing them does), then :meth:`_continue_streams`."""
        spare = [getattr(shard, "index", t) for t, shard in enumerate(self.shards)]
        if self.streams_table is not None and "streams_table" in snapshot:
            self.streams_table.load(snapshot["streams_table"])
            # More ranks than saved streams and spare shards: the others start with nothing to
            # read, and the re-share that follows gives every rank its part of the rows left.
            live = {int(s) for s, _, _ in snapshot["streams"]["live"]}
            have = len(live) + len([s for s in spare if s not in live])
            spare += self.streams_table.add([()] * max(0, len(order) - have))
        plan = plan_streams(
            snapshot["streams"], num_ranks=len(order), spare_shards=spare, step=step
        )
        self.accounting = BatchAccounting.rewound(
            snapshot, gang_ids=gang_ids, stream_id=self._stream_id
        )
        return dict(zip(order, plan, strict=True))

    def _continue_streams(
        self, starts: Mapping[int, StreamStart], *, gang_of: Callable[[int], int], step: int
    ) -> None:
        """Books each rank as reading from ``starts`` at job step ``step``."""
        for r, s in starts.items():
            self.accounting.resume_rank(
                r, gang=gang_of(r), step=step, stream_at=s.at, replay=s.replay
            )

    def _queue_replays(self, starts: Mapping[int, StreamStart]) -> None:
        """Hands each rank the unread replay batches of the stream it continues."""
        replay = {r: list(s.replay) for r, s in starts.items() if s.replay}
        if replay:
            self._call_by_rank(sorted(replay), RankWorker.replay, lambda r: (replay[r],))

    def _shard_of(self, index: int) -> BatchShard:
        """The data shard with this index: one of the job's initial shards, or a new one."""
        if self.streams_table is not None:
            return self.streams_table.shard(index)
        for t, shard in enumerate(self.shards):
            if getattr(shard, "index", t) == index:
                return shard
        if self.new_shard is None:
            raise JobFailedError(f"no data shard {index} to continue after a rebuild")
        new: BatchShard = self.new_shard(index)
        return new
