"""Checkpoints of a running job: when to save, saving, and starting from one.

:class:`JobCheckpoints` is a part of the job with state of its own (the last checkpoint saved).
When to save is a :class:`~raytrec.elastic.decisions.Checkpoint` of
:func:`~raytrec.elastic.boundary.decide` (the rule:
:func:`~raytrec.checkpoint.config.save_decision`); one gang writes after a job-wide sync, so
its copy is the job's state, with the batch accounting, which a rebuild after a total loss or a
resume rewinds to. A resume loads the checkpoint into every gang, resharded to this job's shape,
and continues the saved data streams on any number of ranks. It sees the job through
:class:`CheckpointsPorts`: the point a total loss goes back to and the last save's step and
time are an outcome (:class:`~actors.job.PointSaved`) that a save or a restore returns and the
loop applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from actors.job import PointSaved, Rewound, StreamsRestarted
from actors.ports import GenerationPorts, HasBuild, HasClock, HasGangOf, HasSync
from actors.reshare import DataStreams
from raytrec.checkpoint.config import SCORE_ATTRIBUTES, CheckpointConfig, checkpoint_root
from raytrec.elastic.decisions import RollbackPoint, TotalLoss
from raytrec.elastic.events import CheckpointRestored, CheckpointSaved
from raytrec.elastic.rollback import StreamStart
from raytrec.elastic.workers import RankCallError
from raytrec.observability.metrics import IntervalMetrics

__all__ = ["CheckpointsPorts", "JobCheckpoints"]


class CheckpointsPorts(GenerationPorts, HasGangOf, HasClock, HasSync, HasBuild, Protocol):
    """The ports :class:`JobCheckpoints` calls."""


class JobCheckpoints:
    """Saves and restores the job's checkpoints (module doc). ``progress``: the job's metrics
    rows so far."""

    def __init__(
        self,
        job: CheckpointsPorts,
        *,
        run_dir: str,
        config: CheckpointConfig,
        streams: DataStreams,
        progress: Callable[[], Sequence[IntervalMetrics]],
        data: dict[str, Any] | None = None,
        init_from: str | None = None,
    ) -> None:
        self.job = job
        self.data = data  # the fingerprint of the data read (raytrec.data.fingerprint)
        self.init_from = init_from  # a checkpoint whose model (only) the job starts from
        self.config = config
        self.streams = streams
        self.progress = progress
        self.root = checkpoint_root(run_dir)
        self.last: str | None = None  # the last checkpoint this run saved

    def resume_streams(self, uri: str | None) -> dict[int, StreamStart] | None:
        """Where each rank of this job reads after resuming from ``uri``: the checkpoint's own
        streams continued (:func:`~raytrec.elastic.rollback.plan_streams`, on any number of
        ranks), with its batch accounting restored, so the job goes on with the batches the
        saved one had not trained and counts each batch once across both runs. None, when the
        checkpoint holds no accounting or the source cannot name its batches: the ranks then
        read their own shards from the checkpoint's step (and for no ``uri``: no resume)."""
        saved = self._saved_streams(uri)
        if saved is None:
            return None
        snapshot, step = saved
        return self.streams.rewind_to(
            snapshot,
            order=self.job.ranks_in_gang_order(),
            gang_ids=self.job.view.membership.gang_ids,
            step=step,
        )

    def resumes_streams(self, uri: str | None) -> bool:
        """Whether a resume from ``uri`` continues the checkpoint's streams
        (:meth:`resume_streams`), which it can on any number of gangs."""
        return self._saved_streams(uri) is not None

    def _saved_streams(self, uri: str | None) -> tuple[dict[str, Any], int] | None:
        """The batch accounting of checkpoint ``uri`` and its step, when this job can continue
        its streams (its source names its batches and the checkpoint holds them)."""
        from raytrec.checkpoint.layout import read_manifest

        if uri is None or self.streams.stream_id is None:
            return None
        extra = read_manifest(uri).extra
        snapshot = extra.get("accounting")
        if not snapshot or snapshot.get("streams") is None:
            return None
        return snapshot, int(extra["step"])

    def restore(self, uri: str, starts: dict[int, StreamStart] | None) -> PointSaved:
        """Every gang loads the checkpoint (resharded to this job's shape); step counters go to
        its step, and each rank's stream to ``starts`` (else its own shard at that step).
        Returns the point a total loss now goes back to, for the loop to apply."""
        job = self.job
        ranks = job.live_ranks()
        if starts is None:
            loaded = job.call(ranks, lambda w, _r: w.load_checkpoint(uri))
        else:
            loaded = job.call(ranks, lambda w, r: w.load_checkpoint(uri, starts[r].at))
        step, generation = loaded[0]["step"], loaded[0]["generation"]
        job.apply(Rewound(step, synced=True))
        saved_at = job.clock.monotonic()
        if starts is None:
            job.apply(StreamsRestarted(tuple(ranks), at=step))
        else:
            self.streams.continue_streams(starts, gang_of=job.gang_of, step=step)
            if not self.streams.reshare(job.ranks_in_gang_order()):  # rows left uneven
                self.streams.queue_replays(starts)
        point = RollbackPoint(uri=uri, step=step, accounting=self.accounting_snapshot())
        job.record(
            CheckpointRestored(
                at=job.now(), step=step, uri=uri, saved_step=step, saved_generation=generation
            )
        )
        return PointSaved(point, at=saved_at)

    def start_from(
        self, resume: str | None, starts: dict[int, StreamStart] | None, ranks: list[int]
    ) -> None:
        """The job's ``ranks`` are built and start from a checkpoint: resume ``resume``
        (:meth:`restore`, continuing at ``starts``), or else take the model of ``init_from``
        (:meth:`initialize`). A rank lost (or stuck) meanwhile is raised to the loop, which
        rebuilds the job from ``resume`` as after a total loss (:meth:`resume_lost`)."""
        self.job.build(ranks)
        self.job.new_generation("job started")
        if resume is not None:
            self.job.apply(self.restore(resume, starts))
        elif self.init_from is not None:
            self.initialize(self.init_from)

    def resume_lost(self, resume: str, error: RankCallError) -> TotalLoss:
        """A rank lost as the job resumed from ``resume`` leaves some ranks loaded and others
        not: the total loss that rebuilds the job from that checkpoint."""
        from raytrec.checkpoint.layout import read_manifest

        lost = f"{type(error).__name__} as the job resumed from {resume}"
        extra = read_manifest(resume).extra
        point = RollbackPoint(uri=resume, step=int(extra["step"]), accounting=extra["accounting"])
        gangs = tuple(self.job.view.membership.gang_ids)
        return TotalLoss(lost_shards=(), lost_ranks=(), reason=lost, lost_gangs=gangs, point=point)

    def initialize(self, uri: str) -> None:
        """Every gang loads the model of ``uri`` (weights and optimizer state, resharded to this
        job's shape) and nothing else: the step counters stay at 0 and each rank reads its own
        shard of this job's data from the start (``fit(init_from=...)``)."""
        job = self.job
        loaded = job.call(job.live_ranks(), lambda w, _r: w.load_checkpoint(uri, 0, init=True))
        job.record(
            CheckpointRestored(
                at=job.now(),
                step=0,
                uri=uri,
                saved_step=loaded[0]["step"],
                saved_generation=loaded[0]["generation"],
            )
        )

    def save(self) -> PointSaved:
        """Saves a checkpoint (a :class:`~raytrec.elastic.decisions.Checkpoint` decided here):
        one gang writes, after a job-wide sync (so its copy is the job's state). Returns the
        point a total loss now goes back to and the save's time, for the loop to apply."""
        cfg, job = self.config, self.job
        job.sync()
        writer = list(job.view.membership.gangs[0].job_ranks)
        # The accounting goes into the checkpoint: a rebuild from it rewinds to this state.
        accounting = self.accounting_snapshot()
        step, m = job.step(), job.view.membership
        extra = {
            "step": step,
            "gangs": m.num_gangs,
            "accounting": accounting,
            "metrics": self.metrics(),
        }
        if self.data is not None:  # a resume checks it names the data it reads
            extra["data"] = self.data
        generation, num_gangs = m.generation, m.num_gangs
        refs = job.call(
            writer,
            lambda w, _r: w.save_checkpoint(self.root, generation, extra, cfg, num_gangs),
        )
        self.last = refs[0][1]
        point = RollbackPoint(uri=refs[0][1], step=step, accounting=accounting)
        saved = PointSaved(point, at=job.clock.monotonic())
        job.record(CheckpointSaved(at=job.now(), step=step, uri=refs[0][1]))
        return saved

    def metrics(self) -> dict[str, float]:
        """The metrics of the interval that ended at the job's step (the held-out ones when an
        evaluation ran there): what ranks a checkpoint (``checkpoint_score_attribute``)."""
        rows = self.progress()
        if not rows or rows[-1].step != self.job.step():
            return {}
        row = rows[-1]
        values = {k: getattr(row, k) for k in SCORE_ATTRIBUTES}
        return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}

    def accounting_snapshot(self) -> dict[str, Any]:
        """The batch accounting (and the table of re-shared streams its positions name) as
        JSON, for a checkpoint and for a rewind to it."""
        snapshot = self.job.view.accounting.snapshot(self.job.ranks_in_gang_order())
        if self.streams.table is not None:
            snapshot["streams_table"] = self.streams.table.to_json()
        return snapshot
