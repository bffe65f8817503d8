"""Publishing the model for serving while the job trains (``publish`` in the config): a base
export, then numbered deltas beside it (:mod:`raytrec.serving.deltas`, docs/serving.md).

At a boundary where a publish is due, after a job-wide sync (so every gang holds the same
model), the first gang's ranks copy out the rows that changed since the last publish
(:mod:`raytrec.engine.publish_rows`; gang rank 0 the dense state too), and every live rank then
clears its set: every replica holds what was published. The coordinator assembles each table's
rows from its shards and writes the delta in a background thread, so training waits for the
sync and the copy only. The first publish writes the base instead: the first gang saves the
model as a final model, exported (without a program) into the publish directory. A directory
that holds a base already (a resumed job) gets the next delta of its sequence instead, with
every row.

A rank lost during a publish is recovered from as anywhere else; no set was cleared, so the
next publish carries those rows too. A failed write is raised by the next publish (or the last),
failing the job: a delta stream with rows missing must not go on.
"""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

import torch

from actors.ports import HasClock, HasEvents, HasRankCalls, HasStep, HasSync, HasView
from raytrec.config.train import PublishConfig
from raytrec.elastic.events import ModelPublished
from raytrec.engine.publish_rows import PublishedRows
from raytrec.serving.deltas import DeltaError, DeltaWriter, TableRows
from raytrec.serving.export import MODEL_JSON, base_id, export

__all__ = ["JobPublishing", "PublishingPorts", "assemble_rows"]


def assemble_rows(parts: Sequence[PublishedRows]) -> dict[str, TableRows]:
    """Each table's changed rows, full width, from the shards of one gang's ranks: row-wise
    shards add rows, column-wise shards columns. A row some shard of its table reported and
    another one (holding other columns of it) did not is refused."""
    by_table: dict[str, list] = defaultdict(list)
    for part in parts:
        for shard in part.shards:
            by_table[shard.key].append(shard)
    out: dict[str, TableRows] = {}
    for key, shards in by_table.items():
        ids = torch.unique(torch.cat([s.ids for s in shards]))
        if ids.numel() == 0:
            continue
        dim = max(s.col_offset + s.rows.shape[1] for s in shards)
        rows = torch.empty(ids.numel(), dim, dtype=shards[0].rows.dtype)
        covered = torch.zeros(ids.numel(), dim, dtype=torch.bool)
        for s in shards:
            at = torch.searchsorted(ids, s.ids)
            cols = slice(s.col_offset, s.col_offset + s.rows.shape[1])
            rows[at, cols] = s.rows
            covered[at, cols] = True
        if not bool(covered.all()):
            missing = ids[~covered.all(1)][:5].tolist()
            raise DeltaError(f"table {key}: rows {missing} came without all their columns")
        out[key] = (ids, rows)
    return out


class PublishingPorts(HasRankCalls, HasStep, HasSync, HasEvents, HasClock, HasView, Protocol):
    """The ports :class:`JobPublishing` calls."""


class JobPublishing:
    """Publishes the job's model at the boundaries the config asks for (module doc)."""

    def __init__(self, job: PublishingPorts, *, config: PublishConfig, run_dir: str) -> None:
        self.job = job
        self.every = config.every_n_steps
        self.dir = config.dir if config.dir is not None else os.path.join(run_dir, "serving")
        self.run_dir = run_dir
        self.last: int | None = None  # the step last published
        self.writer: DeltaWriter | None = None
        self.every_row = False  # the next delta carries every row
        if os.path.exists(os.path.join(self.dir, MODEL_JSON)):
            # A base is there (a resumed job, a restarted coordinator): its deltas go on, the
            # first with every row (what the ranks marked may have gone with a lost write).
            self.writer = DeltaWriter(self.dir, base_id(self.dir))
            self.every_row = True

    def due(self, step: int, *, final: bool = False) -> bool:
        """Whether a publish is due at the boundary at ``step``: the first at or after each
        multiple of ``every_n_steps``, and the end (``final``)."""
        if self.every is None or step == self.last:
            return False
        return final or step // self.every > (self.last or 0) // self.every

    def publish(self) -> None:
        """Publishes the model as it is at the job's step (after a job-wide sync)."""
        job = self.job
        started = job.clock.monotonic()
        job.sync()
        step = job.step()
        gang = list(job.view.membership.gangs[0].job_ranks)
        seq, rows = 0, 0
        if self.writer is None:
            self._write_base(gang)
        else:
            first, every_row = gang[0], self.every_row
            parts = job.call(gang, lambda w, r: w.unpublished_rows(r == first, every_row))
            tables = assemble_rows(parts)
            seq = self.writer.publish(step, tables, parts[0].dense)
            rows = sum(ids.numel() for ids, _ in tables.values())
        job.call(job.live_ranks(), lambda w, _r: w.rows_published())
        self.last, self.every_row = step, False
        stall = job.clock.monotonic() - started
        job.record(ModelPublished(at=job.now(), step=step, delta=seq, rows=rows, stall_s=stall))

    def finish(self) -> None:
        """Waits for the last delta's write; raises its error, if it failed."""
        if self.writer is not None:
            self.writer.wait()

    def _write_base(self, gang: list[int]) -> None:
        source = os.path.join(self.run_dir, "publish_base")
        self.job.call(gang, lambda w, _r: w.save(source))
        export(source, self.dir, program=False, quiet=True)
        shutil.rmtree(source, ignore_errors=True)
        self.writer = DeltaWriter(self.dir, base_id(self.dir))
