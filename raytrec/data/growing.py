"""A Parquet directory that keeps growing while the job trains (pure: no Ray, no files).

The job's files are a list in the order they were found: the files there at the start (sorted),
then each later listing's new files (sorted among themselves). Laid end to end in that order
their row groups make the job's row space, so a new file's rows come after every row known
before it, and the rows already given out keep their places: the coordinator hands the new rows
out as it hands out the rows left after a loss (:func:`~raytrec.data.parquet_recut.recut`), and
every row of every file is trained once.

A file counts once it is listed, so it must appear whole under its final name (written under a
name starting with ``.`` or ``_``, which listings skip, or elsewhere, then renamed into place)
and never change after. :func:`new_files` takes a listing apart; :func:`growth_decision` says,
when every row found so far is trained, whether the job waits for more or ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from raytrec.data.parquet_streams import Stream

__all__ = [
    "GrowthStop",
    "Landed",
    "first_batch_from",
    "growth_decision",
    "new_files",
    "shareable",
]


@dataclasses.dataclass(frozen=True)
class Landed:
    """:func:`new_files`'s answer: the files to add, in order, and the known files a listing
    no longer shows (a contract broken: a file trained, or being trained, was removed)."""

    added: tuple[str, ...]
    missing: tuple[str, ...]


def new_files(listing: Sequence[str], known: Sequence[str], *, max_files: int | None) -> Landed:
    """The files of ``listing`` not in ``known``, sorted, at most ``max_files`` files in all."""
    seen = set(listing)
    have = set(known)
    added = sorted(p for p in seen if p not in have)
    if max_files is not None:
        added = added[: max(0, max_files - len(known))]
    return Landed(added=tuple(added), missing=tuple(p for p in known if p not in seen))


@dataclasses.dataclass(frozen=True)
class GrowthStop:
    """Why a growing job ends: ``cause`` ``"files"`` (``max_files`` trained) or ``"idle"``
    (no new file for ``idle_stop_s``), and a sentence for the ledger."""

    cause: str
    reason: str


def growth_decision(
    *,
    files: int,
    max_files: int | None,
    idle_s: float,
    idle_stop_s: float | None,
) -> GrowthStop | None:
    """For a job that has trained every row of the ``files`` files found so far (``idle_s``:
    seconds since the last new file, or since the start): end it, or None to wait for more."""
    if max_files is not None and files >= max_files:
        return GrowthStop("files", f"the {files} files of data.growing.max_files are trained")
    if idle_stop_s is not None and idle_s >= idle_stop_s:
        return GrowthStop(
            "idle",
            f"no new file for {idle_s:.0f} s (data.growing.idle_stop_s={idle_stop_s:g}) and "
            f"every row of the {files} files trained",
        )
    return None


def shareable(rows: int, *, ranks: int, batch_size: int) -> bool:
    """Whether ``rows`` cut among ``ranks`` ranks with no replays queued leave no row over
    (:func:`~raytrec.data.parquet_recut.recut`: ``k = ceil(ceil(rows/B) / ranks)`` batches per
    rank, so ``k * ranks`` batches of at least a row each)."""
    need = -(-rows // batch_size)
    return rows >= ranks and -(-need // ranks) * ranks <= rows


def first_batch_from(stream: Stream, row: int) -> int | None:
    """The first batch of ``stream`` holding a row at or after ``row`` of epoch 0's row space
    (a new file's first row: every row after it is new too); None when it holds none."""
    at = 0  # the stream's batch where the part starts
    for part in stream:
        laid = 0  # rows of the part's runs before this run
        for lo, hi in part.runs:
            if hi > row and part.epoch == 0:
                place = laid + max(lo, row) - lo  # that row's place in the runs laid end to end
                starts = part.local_cuts(0, part.count)
                j = int(np.searchsorted(starts, place, side="right")) - 1
                if j < part.count:
                    return at + j
            laid += hi - lo
        at += part.count
    return None
