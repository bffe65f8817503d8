"""Exactly-once accounting of a running job's batches, across failures (pure).

The coordinator feeds this the ranks' reports of what they trained (``(step, batch id)`` pairs).
A batch trained at or before a job-wide sync is in every replica: committed. Later ones are
pending for their gang. When gangs are lost, their pending batches (including those the lost
ranks took after their last report, known from their stream order: :mod:`~.streams`) go to the
survivors for replay, spread over the survivors' ranks. Built on :class:`~.ledger.DataLedger`
(batch ids as row ids, all in "epoch" 0) and :class:`~.streams.RankStreams`.

Dense gradients are tracked beside: a lost gang's batch whose dense gradient already reached the
survivors' dense parameters (it was trained at or before the step
:func:`~raytrec.elastic.dense.settle_failed_step` names) is replayed *embedding-only*
(:meth:`BatchAccounting.embedding_only`): the rank that replays it gives it a zero dense
gradient, so each batch's dense gradient is in the model once, like its embedding update.

A source that cannot name and rebuild its batches (``replayable=False``) is tracked by count
only: a lost gang's uncommitted batches are then counted in :attr:`lost_batches`.

At a checkpoint, :meth:`BatchAccounting.snapshot` records the accounting as JSON (committed and
replayed batches, and where every stream stands); :meth:`BatchAccounting.rewound` goes back to
it when the job is rebuilt from that checkpoint, so the batches committed after it, which the
rebuilt model does not hold, are trained and committed again instead of counted twice.

What a change needs to know first has a pure query: :func:`last_job_wide_sync` (what a booking
commits), :meth:`BatchAccounting.reports_of_lost` (what lost ranks trained),
:meth:`BatchAccounting.plan_drop` (where dropped gangs' batches go). A reader that may not change
the accounting holds it as an :class:`AccountingView` (those queries only), and hands what it
computed to the one owner that applies it (:meth:`~BatchAccounting.book`,
:meth:`~BatchAccounting.lose_ranks`, :meth:`~BatchAccounting.apply_drop`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from raytrec.elastic.ledger import DataLedger, ReplayPlan
from raytrec.elastic.report import RankReport, TrainedBatch
from raytrec.elastic.rows import RowRanges
from raytrec.elastic.streams import RankStreams, StreamPositions

__all__ = ["AccountingView", "BatchAccounting", "DropPlan", "last_job_wide_sync"]

# Batch ids are non-negative ints below this (the ledger's "rows per epoch").
_ID_SPACE = 1 << 62


def last_job_wide_sync(
    reports: Sequence[RankReport],
    *,
    last_sync_step: int,
    is_job_wide_sync: Callable[[int], bool],
    completed_through: int | None = None,
) -> int | None:
    """The last job-wide sync step the reports cover, or None: syncs at steps after
    ``last_sync_step`` up to the reports' step (at most ``completed_through``) completed on every
    live gang, so what was trained up to the last of them is committed."""
    new_step = max((r.step for r in reports), default=last_sync_step)
    through = new_step if completed_through is None else completed_through
    syncs = [s for s in range(last_sync_step + 1, through + 1) if is_job_wide_sync(s)]
    return syncs[-1] if syncs else None


@dataclasses.dataclass(frozen=True)
class DropPlan:
    """What dropping gangs does to the accounting (:meth:`BatchAccounting.plan_drop`)."""

    ledger: ReplayPlan
    #: Batches whose dense gradient the survivors hold already: replayed embedding-only.
    dense_applied: tuple[int, ...]
    #: Survivor rank -> batch ids it replays (queued in its stream; empty without streams).
    replays: dict[int, list[int]]


class AccountingView(Protocol):
    """:class:`BatchAccounting`, read only: the queries a reader computes a change with."""

    @property
    def streams(self) -> StreamPositions | None: ...
    def snapshot(self, ranks: Sequence[int]) -> dict[str, Any]: ...
    def embedding_only(self, batch_ids: Iterable[int]) -> list[int]: ...
    def reports_of_lost(self, ranks: Iterable[int], *, fail_step: int) -> list[RankReport]: ...
    def plan_drop(
        self,
        gangs: Sequence[int],
        survivors: Sequence[int],
        *,
        ranks_of: Callable[[int], Sequence[int]],
        dense_through: int | None = None,
        rolled_back: Sequence[int] = (),
        rolled_back_dense_through: int | None = None,
    ) -> DropPlan: ...


class BatchAccounting:
    """See the module doc."""

    def __init__(
        self,
        gang_ids: Iterable[int],
        *,
        stream_id: Callable[[int, int], int] | None,
        batch_size: int = 0,
    ) -> None:
        self.ledger = DataLedger(_ID_SPACE, gang_ids)
        # Rows of the committed batches, counted with multiplicity: ``batch_size`` a batch, less
        # what the ranks reported missing from a short one (RankReport.short).
        self.batch_size = batch_size
        self.committed_rows = 0
        self._short: dict[int, int] = {}  # uncommitted batch id -> rows it lacks
        self.streams = RankStreams(stream_id) if stream_id is not None else None
        self.reported_step: dict[int, int] = {}  # job rank -> step of its last report
        self.lost_batches = 0
        self._trained_at: dict[int, int] = {}  # uncommitted batch id -> step it was trained at
        # Uncommitted batch ids whose dense gradient is already in the dense parameters.
        self._dense_applied: set[int] = set()

    # -- membership --------------------------------------------------------------------------

    def add_rank(self, rank: int, *, shard: int, step: int) -> None:
        if self.streams is not None:
            self.streams.add_rank(rank, shard=shard)
        self.reported_step[rank] = step

    def forget_rank(self, rank: int) -> None:
        """A rank that never trained (it failed while starting)."""
        if self.streams is not None:
            self.streams.remove_rank(rank)
        self.reported_step.pop(rank, None)

    def add_gangs(self, gang_ids: Iterable[int]) -> None:
        self.ledger.add_gangs(gang_ids)

    def restart(self, rank: int, *, at: int) -> None:
        """The rank's stream restarts at batch ``at`` (a resume from a checkpoint)."""
        self.reported_step[rank] = at
        if self.streams is not None:
            self.streams.restart(rank, at=at)

    def resume_rank(
        self, rank: int, *, gang: int, step: int, stream_at: int, replay: Sequence[int] = ()
    ) -> None:
        """A rank added with :meth:`add_rank` starts at job step ``step``, reading the batches
        ``replay`` first and then its own stream from batch ``stream_at`` (a rewind)."""
        self.reported_step[rank] = step
        if self.streams is not None:
            self.streams.restart(rank, at=stream_at, replay=replay)
            self.ledger.assign_replay(gang, 0, RowRanges.from_ids(replay))

    def switch_stream(self, rank: int, *, shard: int, old_ends_at: int) -> None:
        """The rank reads stream ``shard`` from its first batch on, after its queued replays;
        its old stream is retired at ``old_ends_at`` (its batches before that are given out)."""
        assert self.streams is not None, "only a source that names its batches has streams"
        old = self.streams.position(rank)[0]
        self.streams.switch(rank, shard=shard)
        self.streams.retire({old: old_ends_at})

    def retire_streams(self, positions: Mapping[int, int]) -> None:
        """Streams no rank continues, each stopped at its position (stream -> next batch)."""
        assert self.streams is not None, "only a source that names its batches has streams"
        self.streams.retire(positions)

    # -- back to a checkpoint ----------------------------------------------------------------

    def snapshot(self, ranks: Sequence[int]) -> dict[str, Any]:
        """The accounting at a sync boundary (a checkpoint) as JSON: committed and replayed
        batches (with multiplicity), the count of lost ones, and, for a replayable source,
        where each of ``ranks`` (the live ranks, in gang order) stands in its stream and where
        the shards no rank reads stopped."""
        streams = None
        if self.streams is not None:
            live = [self.streams.position(r) for r in ranks]
            streams = {
                "live": [[shard, at, list(replay)] for shard, at, replay in live],
                "retired": sorted([s, at] for s, at in self.streams.retired().items()),
            }
        return {
            **self.ledger.snapshot(),
            "lost_batches": self.lost_batches,
            "committed_rows": self.committed_rows,
            "streams": streams,
            # At a sync boundary nothing is pending: these are unread replays.
            "dense_applied": sorted(self._dense_applied),
        }

    @classmethod
    def rewound(
        cls,
        snapshot: Mapping[str, Any],
        *,
        gang_ids: Iterable[int],
        stream_id: Callable[[int, int], int] | None,
        batch_size: int = 0,
    ) -> BatchAccounting:
        """The accounting of ``snapshot`` for a rebuilt job of gangs ``gang_ids`` that has no
        ranks yet: add them with :meth:`add_rank`, then place them with :meth:`resume_rank`.
        Every stream of the snapshot counts as stopped where it was until a rank continues it."""
        acc = cls((), stream_id=stream_id, batch_size=batch_size)
        acc.ledger.rewind(snapshot, gang_ids)
        acc.lost_batches = int(snapshot["lost_batches"])
        # A checkpoint written before rows were counted: its batches taken as full ones.
        acc.committed_rows = int(
            snapshot.get("committed_rows", acc.ledger.committed_rows(0) * batch_size)
        )
        acc._dense_applied = {int(i) for i in snapshot.get("dense_applied", ())}
        streams = snapshot["streams"]
        if acc.streams is not None and streams is not None:
            stopped = {int(s): int(at) for s, at, _ in streams["live"]}
            stopped.update({int(s): int(at) for s, at in streams["retired"]})
            acc.streams.retire(stopped)
        return acc

    # -- reports -----------------------------------------------------------------------------

    def record(
        self,
        reports: Sequence[RankReport],
        *,
        gang_of: Callable[[int], int],
        live_gangs: Sequence[int],
        last_sync_step: int,
        is_job_wide_sync: Callable[[int], bool],
        completed_through: int | None = None,
    ) -> int | None:
        """Books the reports; returns the last job-wide sync step they covered, or None
        (:func:`last_job_wide_sync`, then :meth:`book`)."""
        last_sync = last_job_wide_sync(
            reports,
            last_sync_step=last_sync_step,
            is_job_wide_sync=is_job_wide_sync,
            completed_through=completed_through,
        )
        self.book(reports, gang_of=gang_of, live_gangs=live_gangs, synced_at=last_sync)
        return last_sync

    def book(
        self,
        reports: Sequence[RankReport],
        *,
        gang_of: Callable[[int], int],
        live_gangs: Sequence[int],
        synced_at: int | None,
    ) -> None:
        """Books the reports: what was trained up to ``synced_at``, the last job-wide sync they
        cover (:func:`last_job_wide_sync`), is committed, the rest is pending."""
        before: dict[int, list[int]] = {}
        after: dict[int, list[int]] = {}
        for rep in reports:
            rank = rep.rank
            if self.streams is not None and not rep.lost:
                self.streams.trained(rank, [i for _, i in rep.trained])
            gang = gang_of(rank)
            for step, batch in rep.trained:
                if batch is None:
                    continue
                self._trained_at[batch] = step
                bucket = before if synced_at is not None and step <= synced_at else after
                bucket.setdefault(gang, []).append(batch)
            self.reported_step[rank] = rep.step
            for batch, rows in rep.short:
                self._short[batch] = self.batch_size - rows
        for gang, ids in before.items():
            self.ledger.consume(gang, 0, RowRanges.from_ids(ids))
        if synced_at is not None:
            self.commit(live_gangs)
        for gang, ids in after.items():
            self.ledger.consume(gang, 0, RowRanges.from_ids(ids))

    def lost_rank_reports(self, ranks: Iterable[int], *, fail_step: int) -> list[RankReport]:
        """Reports for ranks that died, the ranks forgotten (:meth:`reports_of_lost`, then
        :meth:`lose_ranks`)."""
        reports = self.reports_of_lost(ranks, fail_step=fail_step)
        self.lose_ranks(reports)
        return reports

    def reports_of_lost(self, ranks: Iterable[int], *, fail_step: int) -> list[RankReport]:
        """Reports for ranks that died: one batch per step since their last report, the next
        in their stream order. A rank never booked (of a gang lost while it joined, before it
        was given rows to read) trained nothing: no report. Changes nothing."""
        out = []
        for r in dict.fromkeys(ranks):
            if r not in self.reported_step:
                continue
            since = self.reported_step[r]
            count = max(0, fail_step - since)
            streams = self.streams
            ids: list[int | None] = [None] * count if streams is None else [*streams.peek(r, count)]
            trained: tuple[TrainedBatch, ...] = tuple(
                zip(range(since + 1, fail_step + 1), ids, strict=True)
            )
            out.append(RankReport(rank=r, step=fail_step, trained=trained, lost=True))
        return out

    def lose_ranks(self, reports: Iterable[RankReport]) -> None:
        """Forgets the ranks of :meth:`reports_of_lost`'s ``reports``: each stream retires after
        the batches its report names; without streams, those batches count as lost."""
        for rep in reports:
            del self.reported_step[rep.rank]
            count = len(rep.trained)
            if self.streams is not None:
                self.streams.take(rep.rank, count)
                self.streams.remove_rank(rep.rank)
            else:
                self.lost_batches += count

    def commit(self, live_gangs: Iterable[int]) -> None:
        """A job-wide sync just completed: everything trained so far is in every replica."""
        live_gangs = list(live_gangs)
        for g in live_gangs:
            for batch in self.ledger.pending(g).get(0, RowRanges()):
                self._trained_at.pop(batch, None)
                self._dense_applied.discard(batch)
                self.committed_rows += self.batch_size - self._short.pop(batch, 0)
        self.ledger.commit(live_gangs)

    def plan_drop(
        self,
        gangs: Sequence[int],
        survivors: Sequence[int],
        *,
        ranks_of: Callable[[int], Sequence[int]],
        dense_through: int | None = None,
        rolled_back: Sequence[int] = (),
        rolled_back_dense_through: int | None = None,
    ) -> DropPlan:
        """What dropping ``gangs`` does (the accounting unchanged; :meth:`apply_drop` does it):
        their uncommitted batches, split over the ``survivors``' ranks (``ranks_of``: a gang's
        ranks), each queued in its stream to replay.

        ``dense_through``: the last step whose dense update the survivors' dense parameters
        hold (:func:`~raytrec.elastic.dense.settle_failed_step`); the dropped gangs' batches
        trained at or before it are replayed embedding-only. None: no step's (a drain, after a
        job-wide sync, leaves nothing to replay). ``rolled_back``: survivors whose model copies
        are replaced (:mod:`~raytrec.elastic.group_rollback`); their pending batches are
        replayed too, embedding-only when trained at or before ``rolled_back_dense_through``
        (:attr:`~raytrec.elastic.dense.FailedStepSettlement.survivors_through`)."""
        dense: list[int] = []
        for through, of in ((dense_through, gangs), (rolled_back_dense_through, rolled_back)):
            for g in of:
                for batch in self.ledger.pending(g).get(0, RowRanges()):
                    at = self._trained_at.get(batch)
                    if through is not None and at is not None and at <= through:
                        dense.append(batch)
        plan = self.ledger.plan_drop(gangs, survivors, rolled_back=rolled_back)
        assignments: dict[int, list[int]] = {}
        if self.streams is not None:
            for gid, share in plan.shares.items():
                ids = [i for rows in share.values() for i in rows]
                ranks = ranks_of(gid)
                for k, batch in enumerate(ids):
                    assignments.setdefault(ranks[k % len(ranks)], []).append(batch)
        return DropPlan(ledger=plan, dense_applied=tuple(dense), replays=assignments)

    def apply_drop(self, plan: DropPlan) -> dict[int, list[int]]:
        """Drops gangs as ``plan`` (a :meth:`plan_drop` made on the accounting as it is now)
        says; returns its survivor rank -> batch ids to replay, now queued in their streams."""
        self._dense_applied.update(plan.dense_applied)
        self.ledger.apply_drop(plan.ledger)
        if self.streams is not None:
            for rank, ids in plan.replays.items():
                self.streams.queue_replay(rank, ids)
        return plan.replays

    def embedding_only(self, batch_ids: Iterable[int]) -> list[int]:
        """Those of ``batch_ids`` (replays) that update their embedding rows only: their dense
        gradient is already in the dense parameters."""
        return [i for i in batch_ids if i in self._dense_applied]

    # -- results -----------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, int]]:
        return list(self.ledger.committed(0).ranges)

    def committed_count(self) -> int:
        """Committed batches counted with multiplicity (equal to the distinct ones when no
        batch went into the model twice)."""
        return self.ledger.committed_rows(0)

    def replayed(self) -> list[tuple[int, int]]:
        return list(self.ledger.replayed(0).ranges)

    def replay_pending(self) -> int:
        """Replay batches handed out and not trained yet."""
        return sum(
            r.count
            for due in map(self.ledger.replay_due, self.ledger.gang_ids)
            for r in due.values()
        )
