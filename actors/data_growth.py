"""The coordinator's watch over a growing Parquet source (``data.growing``).

At a boundary between intervals, every ``data.growing.poll_s``, the directory is listed; files
not seen before (:func:`~raytrec.data.growing.new_files`) have their footers read and are added
to the job's data after the others, their rows shared with the rows left among the live ranks
(:meth:`~actors.reshare.DataStreams.grow`): the same re-share a loss makes, so every row of
every file is trained once whatever is lost or joins. When every row found so far is trained,
the job waits for more files, or ends (:func:`~raytrec.data.growing.growth_decision`).

The files the job knows are its table's (:class:`~actors.reshare.StreamTable`), so a rewind to
a checkpoint forgets the files found after it, and the next listing finds them again.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

import pyarrow.fs as pafs

from actors.job import Prepared
from actors.ports import HasClock, HasEvents, HasShared
from actors.reshare import DataStreams
from raytrec.data.config import DataConfig, GrowingConfig
from raytrec.data.growing import GrowthStop, growth_decision, new_files
from raytrec.data.parquet import ParquetFileInfo, ParquetSource
from raytrec.elastic.events import DataGrowthEnded, FilesLanded
from raytrec.elastic.workers import RankCallError
from raytrec.errors import JobFailedError

__all__ = ["DataGrowth", "DataGrowthPorts", "growing_root"]


def growing_root(path: str) -> str:
    """``data.path`` as the coordinator lists it: a path within its filesystem."""
    return pafs.FileSystem.from_uri(path)[1] if "://" in path else os.path.abspath(path)


class DataGrowthPorts(HasEvents, HasClock, HasShared, Protocol):
    """The ports :class:`DataGrowth` calls."""


class DataGrowth:
    """See the module doc. ``root``: the directory to list (:func:`growing_root`)."""

    def __init__(
        self, job: DataGrowthPorts, streams: DataStreams, *, config: GrowingConfig, root: str
    ) -> None:
        assert streams.table is not None, "a growing source is read by index"
        self.job, self.streams, self.cfg = job, streams, config
        template = streams.table.template
        self.listing = ParquetSource(
            paths=[root], spec=template.source_spec, filesystem=template.filesystem
        )
        self.fs = template.filesystem
        streams.table.growing = True  # its checkpoints keep the files, in the order found
        self.last_poll: float | None = None
        self.last_new = job.clock.monotonic()
        self.waiting: list[ParquetFileInfo] = []  # found, too few rows to share yet
        self.ended: GrowthStop | None = None
        self.found_at: dict[str, float] = {}  # wall-clock time each waiting file was listed

    @classmethod
    def of(cls, job: DataGrowthPorts, streams: DataStreams, data: DataConfig) -> DataGrowth | None:
        """The watch over ``data.path`` when ``data.growing`` is set (a source read by index)."""
        if data.growing is None or streams.table is None or data.path is None:
            return None
        return cls(job, streams, config=data.growing, root=growing_root(data.path))

    def boundary(self) -> bool:
        """At a boundary with nothing in flight: adds new files when a poll is due; True when
        the ranks have rows to train, else waits for the next poll and returns False
        (``ended`` says when the job's data ended instead)."""
        self.poll()
        if self.job.view.step < self.job.view.end_step:
            return True
        self.ended = self.end()
        if self.ended is None:
            self.wait()
        return False

    def due(self) -> bool:
        last = self.last_poll
        return last is None or self.job.clock.monotonic() - last >= self.cfg.poll_s

    def poll(self) -> bool:
        """Lists the directory when a poll is due and adds the new files; True when some were
        added (every live rank then reads a new stream: what they had prepared is dropped)."""
        if not self.due():
            return False
        self.last_poll = self.job.clock.monotonic()
        table = self.streams.table
        assert table is not None
        known = [*table.template.paths, *(i.path for i in self.waiting)]
        _, listing = self.listing.list_files()
        landed = new_files(listing, known, max_files=self.cfg.max_files)
        if landed.missing:
            raise JobFailedError(
                f"files of the growing source were removed while the job read them: "
                f"{', '.join(landed.missing[:5])}"
            )
        if landed.added:
            self.last_new = self.job.clock.monotonic()
            self.found_at.update((p, time.time()) for p in landed.added)
            self.waiting += self.listing.footers(list(landed.added))
        if not self.waiting:
            return False
        # Taken out first: a loss during the re-share below must not add them twice.
        infos, self.waiting = self.waiting, []
        before = len(table.template.paths)
        try:
            grown = self.streams.grow([i.path for i in infos], [i.row_group_rows for i in infos])
        except RankCallError:
            if len(table.template.paths) > before:  # added: the recovery shares their rows
                self._landed(infos, rows=sum(i.rows for i in infos), first_step=None)
            raise
        if grown is None:
            self.waiting = infos  # too few rows for a batch per rank yet, or replays queued
            return False
        rows, first = grown
        self.job.apply(Prepared(0))
        self._landed(infos, rows=rows, first_step=self.job.view.step + 1 + first)
        return True

    def _landed(self, infos: list[ParquetFileInfo], *, rows: int, first_step: int | None) -> None:
        paths = [i.path for i in infos]
        stats = self.fs.get_file_info(paths)
        self.job.record(
            FilesLanded(
                at=self.job.now(),
                step=self.job.view.step,
                paths=tuple(paths),
                rows=rows,
                end_step=self.job.view.end_step,
                first_step=first_step,
                landed_at=tuple(round(s.mtime_ns / 1e9, 3) for s in stats),
                found_at=tuple(round(self.found_at.pop(p), 3) for p in paths),
            )
        )

    def end(self) -> GrowthStop | None:
        """For a job that has trained every row it knows: why it ends now, or None to wait."""
        table = self.streams.table
        assert table is not None
        files = len(table.template.paths)
        stop = growth_decision(
            files=files if not self.waiting else files + len(self.waiting),
            max_files=self.cfg.max_files if not self.waiting else None,
            idle_s=self.job.clock.monotonic() - self.last_new,
            idle_stop_s=self.cfg.idle_stop_s,
        )
        if stop is not None:
            self.job.record(
                DataGrowthEnded(
                    at=self.job.now(), step=self.job.view.step, files=files, reason=stop.reason
                )
            )
        return stop

    def wait(self) -> None:
        """Waits for the next poll (at most a second at a time: a stop request is seen then)."""
        last = self.last_poll if self.last_poll is not None else self.job.clock.monotonic()
        left = last + self.cfg.poll_s - self.job.clock.monotonic()
        self.job.clock.sleep(max(0.05, min(1.0, left)))
