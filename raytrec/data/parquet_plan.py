"""Which rows make each batch of each rank when Parquet is read by index (pure: numpy only).

The unit of order is the row group: the files' row groups, in listing order, or with
``shuffle_seed`` in a seeded order drawn afresh for every epoch, laid end to end make the epoch's
row space ``[0, N)``. Rank ``r`` of ``T`` owns the contiguous share ``[r*N//T, (r+1)*N//T)``, cut
into ``m = ceil(ceil(N/T) / B)`` nearly equal batches (``floor(j*S/m)`` is where batch ``j`` of a
share of ``S`` rows starts). So every rank has the same number of batches per epoch (ranks train in
lockstep and cross epochs together), no batch exceeds ``B`` rows, a share that ``B`` divides is cut
into batches of exactly ``B``, and every row of an epoch is in exactly one batch of one rank.

A rank's step ``s`` is batch ``s mod m`` of its share in epoch ``s // m``; ``(rank, step)`` names a
batch for the whole job, and :meth:`BatchPlan.pieces` turns any range of a rank's steps back into
row ranges of row groups. Contiguous shares (rather than dealing batches round-robin) keep each
rank's reads within its own row groups: a row group is decoded by at most the two ranks whose
shares meet inside it, not by every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

__all__ = ["BatchPlan", "Piece"]

_CACHED_EPOCHS = 4  # epoch orders kept: a rank reads one epoch at a time, replays are recent


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of row group ``row_group`` of file ``path`` (``file_row``: the index
    of row ``start`` within its file), read for consecutive steps of one rank: ``counts[i]`` rows
    belong to step ``step + i``."""

    path: str
    row_group: int
    start: int
    stop: int
    file_row: int
    step: int
    counts: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """The assignment of the module doc. ``row_groups[i]``: the row count of each row group of
    ``paths[i]``. Raises ValueError when some batch would have no rows (fewer rows than ranks,
    or batches of one row that the shares cannot fill)."""

    paths: tuple[str, ...]
    row_groups: tuple[tuple[int, ...], ...]
    num_shards: int
    batch_size: int
    epochs: int
    shuffle_seed: int | None = None
    _orders: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        def check(field: str, value: object, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"BatchPlan.{field} must be {allowed}, got {value!r}")

        check("num_shards", self.num_shards, self.num_shards >= 1, ">= 1")
        check("batch_size", self.batch_size, self.batch_size >= 1, ">= 1")
        check("epochs", self.epochs, self.epochs >= 1, ">= 1")
        per_path = len(self.row_groups) == len(self.paths)
        check("row_groups", self.row_groups, per_path, f"one tuple per path ({len(self.paths)})")
        counts_ok = all(n >= 0 for g in self.row_groups for n in g)
        check("row_groups", self.row_groups, counts_ok, "row counts >= 0")
        if self.shuffle_seed is not None:
            check("shuffle_seed", self.shuffle_seed, self.shuffle_seed >= 0, "None or >= 0")
        n, t = self.rows_per_epoch, self.num_shards
        if n < t:
            raise ValueError(f"the data has {n} rows, fewer than the {t} ranks that share it")
        smallest = n // t
        if smallest < self.steps_per_epoch:
            raise ValueError(
                f"{n} rows over {t} ranks in batches of {self.batch_size} leave some rank "
                f"{smallest} rows for {self.steps_per_epoch} batches: a batch would be empty"
            )

    # -- sizes -------------------------------------------------------------------------------

    @functools.cached_property
    def _unit_rows(self) -> np.ndarray:
        return np.fromiter((n for g in self.row_groups for n in g), dtype=np.int64)

    @functools.cached_property
    def _unit_where(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row group: its file's index, its index in the file, its first row in the file."""
        sizes = np.array([len(g) for g in self.row_groups], dtype=np.int64)
        files = np.repeat(np.arange(len(self.paths)), sizes)
        first_unit = np.repeat(np.cumsum(sizes) - sizes, sizes)  # of each row group's file
        groups = np.arange(len(files)) - first_unit
        first_row = np.cumsum(self._unit_rows) - self._unit_rows  # counted over all files
        starts = first_row - first_row[first_unit]
        return files, groups.astype(np.int64), starts.astype(np.int64)

    @functools.cached_property
    def rows_per_epoch(self) -> int:
        return int(self._unit_rows.sum())

    @functools.cached_property
    def steps_per_epoch(self) -> int:
        """``m``: batches of every rank per epoch."""
        largest = math.ceil(self.rows_per_epoch / self.num_shards)
        return math.ceil(largest / self.batch_size)

    @property
    def num_steps(self) -> int:
        """Batches of every rank over all epochs."""
        return self.epochs * self.steps_per_epoch

    def share(self, rank: int) -> tuple[int, int]:
        """``(first row, rows)`` of rank ``rank``'s share of each epoch's row space."""
        self._check_rank(rank)
        n, t = self.rows_per_epoch, self.num_shards
        start = rank * n // t
        return start, (rank + 1) * n // t - start

    def batch_rows(self, rank: int, step: int) -> tuple[int, int, int]:
        """``(epoch, start, stop)``: batch ``step`` of ``rank`` is rows ``[start, stop)`` of the
        rank's share in that epoch."""
        self._check_step(step)
        m = self.steps_per_epoch
        epoch, j = divmod(step, m)
        _, size = self.share(rank)
        return epoch, j * size // m, (j + 1) * size // m

    def batch_size_of(self, rank: int, step: int) -> int:
        _, start, stop = self.batch_rows(rank, step)
        return stop - start

    # -- rows --------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row groups (indices in listing order) laid end to end in ``epoch``."""
        return self._order(epoch)[0]

    def pieces(self, rank: int, first_step: int, stop_step: int) -> list[Piece]:
        """The rows of ``rank``'s steps ``[first_step, stop_step)``, in step order, as pieces of
        row groups (a piece never spans two row groups or two epochs)."""
        if first_step >= stop_step:
            return []
        self._check_step(first_step)
        self._check_step(stop_step - 1)
        m = self.steps_per_epoch
        share_start, size = self.share(rank)
        files, groups, file_starts = self._unit_where
        out: list[Piece] = []
        for epoch in range(first_step // m, (stop_step - 1) // m + 1):
            j0 = max(first_step - epoch * m, 0)
            j1 = min(stop_step - epoch * m, m)
            # Where the steps j0 .. j1 start in the share; the last entry is where j1 - 1 ends.
            cuts = np.arange(j0, j1 + 1, dtype=np.int64) * size // m
            order, ends = self._order(epoch)
            lo, hi = share_start + int(cuts[0]), share_start + int(cuts[-1])
            k = int(np.searchsorted(ends, lo, side="right"))
            while lo < hi:
                unit = int(order[k])
                stop = min(hi, int(ends[k]))
                k += 1
                if stop == lo:  # a row group with no rows
                    continue
                unit_start = int(ends[k - 1]) - int(self._unit_rows[unit])
                # Rows [lo, stop) of the epoch as share offsets [a, b), then their steps.
                a, b = lo - share_start, stop - share_start
                first = int(np.searchsorted(cuts, a, side="right")) - 1
                last = int(np.searchsorted(cuts, b - 1, side="right")) - 1
                bounds = np.clip(cuts[first : last + 2], a, b)
                out.append(
                    Piece(
                        path=self.paths[int(files[unit])],
                        row_group=int(groups[unit]),
                        start=lo - unit_start,
                        stop=stop - unit_start,
                        file_row=int(file_starts[unit]) + lo - unit_start,
                        step=epoch * m + j0 + first,
                        counts=tuple(int(c) for c in np.diff(bounds)),
                    )
                )
                lo = stop
        return out

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's row-group order and the cumulative row count at the end of each."""
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch must be in [0, {self.epochs}), got {epoch!r}")
        hit = self._orders.get(epoch)
        if hit is not None:
            return hit
        units = len(self._unit_rows)
        if self.shuffle_seed is None:
            order = np.arange(units)
        else:
            order = np.random.default_rng([self.shuffle_seed, epoch]).permutation(units)
        ends = np.cumsum(self._unit_rows[order])
        if len(self._orders) >= _CACHED_EPOCHS:
            self._orders.pop(next(iter(self._orders)))
        self._orders[epoch] = (order, ends)
        return order, ends

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank must be in [0, {self.num_shards}), got {rank!r}")

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must be in [0, {self.num_steps}), got {step!r}")
