"""Checkpoints of a running job: when to save, saving, and starting from one.

:class:`JobCheckpoints` is a part of :class:`~actors.coordinator.Coordinator` with state of its own
(the last save's step and time, the last checkpoint). When to save is a
:class:`~raytrec.elastic.decisions.Checkpoint` of :func:`~raytrec.elastic.boundary.decide` (the
rule: :func:`~raytrec.checkpoint.config.save_decision`); one gang writes after a job-wide sync, so
its copy is the job's state, with the batch accounting, which a rebuild after a total loss or a
resume rewinds to. A resume loads the checkpoint into every gang, resharded to this job's shape, and
continues the saved data streams on any number of ranks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from raytrec.checkpoint.config import SCORE_ATTRIBUTES, checkpoint_root
from raytrec.elastic.decisions import RollbackPoint
from raytrec.elastic.events import CheckpointRestored, CheckpointSaved
from raytrec.elastic.rollback import StreamStart

if TYPE_CHECKING:
    from actors.coordinator import Coordinator

__all__ = ["JobCheckpoints"]


class JobCheckpoints:
    """Saves and restores the job's checkpoints (module doc)."""

    def __init__(self, job: Coordinator) -> None:
        self.job = job
        self.root = checkpoint_root(job.run_dir)
        self.last: str | None = None  # the last checkpoint this run saved
        self.last_save = (0, job.clock.monotonic())  # (step, clock) of the last save (or start)

    def resume_streams(self, uri: str) -> dict[int, StreamStart] | None:
        """Where each rank of this job reads after resuming from ``uri``: the checkpoint's own
        streams continued (:func:`~raytrec.elastic.rollback.plan_streams`, on any number of
        ranks), with its batch accounting restored, so the job goes on with the batches the
        saved one had not trained and counts each batch once across both runs. None, when the
        checkpoint holds no accounting or the source cannot name its batches: the ranks then
        read their own shards from the checkpoint's step."""
        from raytrec.checkpoint.layout import read_manifest

        extra = read_manifest(uri).extra
        snapshot = extra.get("accounting")
        if self.job._stream_id is None or not snapshot or snapshot.get("streams") is None:
            return None
        return self.job.streams.rewind_to(
            snapshot,
            order=self.job._ranks_in_gang_order(),
            gang_ids=self.job.membership.gang_ids,
            step=int(extra["step"]),
        )

    def restore(self, uri: str, starts: dict[int, StreamStart] | None) -> None:
        """Every gang loads the checkpoint (resharded to this job's shape); step counters go to
        its step, and each rank's stream to ``starts`` (else its own shard at that step)."""
        ranks = self.job._live_ranks()
        if starts is None:
            loaded = self.job._call(ranks, lambda w, _r: w.load_checkpoint(uri))
        else:
            loaded = self.job._call(ranks, lambda w, r: w.load_checkpoint(uri, starts[r].at))
        step, generation = loaded[0]["step"], loaded[0]["generation"]
        self.job.step = step
        self.last_save = (step, self.job.clock.monotonic())
        if starts is None:
            for r in ranks:
                self.job.accounting.restart(r, at=step)
        else:
            self.job.streams.continue_streams(starts, gang_of=self.job._gang_of, step=step)
            if not self.job.streams.reshare(self.job._ranks_in_gang_order()):  # rows left uneven
                self.job.streams.queue_replays(starts)
        self.job.membership = self.job.membership.synced(step)
        self.job.total_loss.point = RollbackPoint(
            uri=uri, step=step, accounting=self.accounting_snapshot()
        )
        self.job.events.append(
            CheckpointRestored(
                at=self.job._now(), step=step, uri=uri, saved_step=step, saved_generation=generation
            )
        )

    def save(self) -> None:
        """Saves a checkpoint (a :class:`~raytrec.elastic.decisions.Checkpoint` decided here):
        one gang writes, after a job-wide sync (so its copy is the job's state)."""
        cfg = self.job.cfg.checkpoint
        if self.job.membership.last_sync_step != self.job.step:
            self.job._call(self.job._live_ranks(), lambda w, _r: w.sync())
            self.job._commit_all()
        writer = list(self.job.membership.gangs[0].job_ranks)
        # The accounting goes into the checkpoint: a rebuild from it rewinds to this state.
        accounting = self.accounting_snapshot()
        extra = {
            "step": self.job.step,
            "gangs": self.job.membership.num_gangs,
            "accounting": accounting,
            "metrics": self.metrics(),
        }
        generation, num_gangs = self.job.membership.generation, self.job.membership.num_gangs
        refs = self.job._call(
            writer,
            lambda w, _r: w.save_checkpoint(self.root, generation, extra, cfg, num_gangs),
        )
        self.last = refs[0][1]
        self.job.total_loss.point = RollbackPoint(
            uri=refs[0][1], step=self.job.step, accounting=accounting
        )
        self.last_save = (self.job.step, self.job.clock.monotonic())
        self.job.events.append(
            CheckpointSaved(at=self.job._now(), step=self.job.step, uri=refs[0][1])
        )

    def metrics(self) -> dict[str, float]:
        """The metrics of the interval that ended at the job's step (the held-out ones when an
        evaluation ran there): what ranks a checkpoint (``checkpoint_score_attribute``)."""
        rows = self.job.progress()
        if not rows or rows[-1].step != self.job.step:
            return {}
        row = rows[-1]
        values = {k: getattr(row, k) for k in SCORE_ATTRIBUTES}
        return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}

    def accounting_snapshot(self) -> dict[str, Any]:
        """The batch accounting (and the table of re-shared streams its positions name) as
        JSON, for a checkpoint and for a rewind to it."""
        snapshot = self.job.accounting.snapshot(self.job._ranks_in_gang_order())
        if self.job.streams.table is not None:
            snapshot["streams_table"] = self.job.streams.table.to_json()
        return snapshot
