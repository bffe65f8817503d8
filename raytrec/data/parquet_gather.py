"""Rows shuffled within a window: which rows of which row groups a run of batches gathers (pure).

With ``shuffle_window_rows = W`` an epoch's row space (its row groups laid end to end in the
epoch's order, :class:`~raytrec.data.parquet_plan.BatchPlan`) is cut into windows of ``W``
consecutive rows, ``[k*W, (k+1)*W)`` (the last one shorter), and the rows of window ``k`` are
permuted by a generator seeded with ``(shuffle_seed, epoch, k)``: place ``p`` of the row space
holds the row at ``k*W + perm_k[p - k*W]``. Batches, shares and re-shares are still cut from
places, as without a window, so every row is in exactly one batch per epoch; only which row
sits at a place changes. A window is consecutive rows, so the rows a run of batches needs from
one window lie in at most ``W`` consecutive rows of the row space: a read of them holds at
most ``W`` rows, whatever the row groups' sizes.

A :class:`Gather` is one such read: ranges of row groups read one after the other, then the
rows taken in batch order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

__all__ = ["Gather", "RowRange", "gather", "window_permutation"]


@dataclasses.dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of row group ``row_group`` of file ``path`` (``file_row``: the index
    of row ``start`` within its file)."""

    path: str
    row_group: int
    start: int
    stop: int
    file_row: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Gather:
    """Consecutive steps' rows of one window: ``reads`` read and laid end to end, then rows
    ``take`` of them in that order; ``counts[i]`` rows belong to step ``step + i``."""

    reads: tuple[RowRange, ...]
    take: np.ndarray
    step: int
    counts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return len(self.take)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.path for r in self.reads))

    def steps(self) -> np.ndarray:
        """Each taken row's step."""
        return np.repeat(np.arange(self.step, self.step + len(self.counts)), self.counts)

    def runs(self) -> list[tuple[RowRange, int, tuple[int, ...]]]:
        """The taken rows, in order, as maximal runs of consecutive rows of one row group: each
        its range, its first row's step and its rows per step."""
        if not self.rows:
            return []
        sizes = np.array([r.rows for r in self.reads], dtype=np.int64)
        starts = np.cumsum(sizes) - sizes
        which = np.searchsorted(starts, self.take, side="right") - 1
        offset = self.take - starts[which]
        steps = self.steps()
        breaks = np.flatnonzero((np.diff(which) != 0) | (np.diff(offset) != 1))
        out = []
        bounds = [0, *(breaks + 1).tolist(), self.rows]
        for a, b in itertools.pairwise(bounds):
            read = self.reads[int(which[a])]
            lo = read.start + int(offset[a])
            run = RowRange(
                read.path, read.row_group, lo, lo + b - a, read.file_row + lo - read.start
            )
            run_steps = steps[a:b]
            first = int(run_steps[0])
            counts = np.bincount(run_steps - first)
            out.append((run, first, tuple(int(c) for c in counts)))
        return out


def window_permutation(seed: int, epoch: int, window: int, size: int) -> np.ndarray:
    """The order of window ``window``'s ``size`` rows in ``epoch``: a pure function of these."""
    return np.random.default_rng([seed, epoch, window]).permutation(size)


def gather(
    rows: np.ndarray,
    *,
    order: np.ndarray,
    ends: np.ndarray,
    unit_rows: np.ndarray,
    where: tuple[np.ndarray, np.ndarray, np.ndarray],
    paths: Sequence[str],
    step: int,
    counts: Sequence[int],
) -> Gather:
    """The read of ``rows`` (places in an epoch's row space, in batch order). ``order``: the
    epoch's row groups; ``ends``: the row space's count at the end of each; ``unit_rows``: rows
    per row group; ``where``: per row group its file, index in the file and first row in it."""
    files, groups, file_starts = where
    k = np.searchsorted(ends, rows, side="right")  # an empty row group never holds a row
    units = order[k]
    offset = rows - (ends[k] - unit_rows[units])
    touched, inverse = np.unique(k, return_inverse=True)
    lo = np.full(len(touched), np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(len(touched), dtype=np.int64)
    np.minimum.at(lo, inverse, offset)
    np.maximum.at(hi, inverse, offset + 1)
    sizes = hi - lo
    base = np.cumsum(sizes) - sizes
    reads = tuple(
        RowRange(
            path=paths[int(files[u])],
            row_group=int(groups[u]),
            start=int(a),
            stop=int(b),
            file_row=int(file_starts[u]) + int(a),
        )
        for u, a, b in zip(order[touched].tolist(), lo.tolist(), hi.tolist(), strict=True)
    )
    return Gather(
        reads=reads,
        take=base[inverse] + offset - lo[inverse],
        step=step,
        counts=tuple(int(c) for c in counts),
    )
