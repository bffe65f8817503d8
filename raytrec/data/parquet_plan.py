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

With ``shuffle_window_rows`` the rows of each window of that many consecutive rows of the row
space are permuted too (:mod:`raytrec.data.parquet_gather`): the cuts above stay, the rows at
their places change, and :meth:`BatchPlan.stream_reads` describes reads as gathers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from raytrec.data.parquet_gather import Gather, gather, window_permutation
from raytrec.data.parquet_streams import Part, Stream

__all__ = ["BatchPlan", "Piece", "Read"]

_CACHED_EPOCHS = 4  # epoch orders kept: a rank reads one epoch at a time, replays are recent
_CACHED_WINDOWS = 4  # window permutations kept: a rank reads a window or two at a time


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


#: What a rank reads for a run of its batches: rows of one row group, or a window's gather.
Read = Piece | Gather


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
    shuffle_window_rows: int | None = None
    _orders: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _windows: dict[tuple[int, int], np.ndarray] = dataclasses.field(
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
        window = self.shuffle_window_rows
        if window is not None:
            check("shuffle_window_rows", window, window >= 1, "None or >= 1")
            seeded = self.shuffle_seed is not None
            check("shuffle_window_rows", window, seeded, "None without a shuffle_seed")
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

    def stream(self, rank: int, *, limit: int | None = None) -> Stream:
        """Rank ``rank``'s batches as a :class:`Stream`: per epoch, its share cut into
        ``steps_per_epoch`` batches; only the first ``limit`` batches when given."""
        start, size = self.share(rank)
        m = self.steps_per_epoch
        total = self.num_steps if limit is None else max(0, min(limit, self.num_steps))
        return tuple(
            Part(
                epoch=e,
                runs=((start, start + size),),
                total=size,
                cut=m,
                count=min(m, total - e * m),
            )
            for e in range(math.ceil(total / m))
        )

    def pieces(self, rank: int, first_step: int, stop_step: int) -> list[Piece]:
        """The rows of ``rank``'s steps ``[first_step, stop_step)``, in step order, as pieces of
        row groups (a piece never spans two row groups or two epochs)."""
        if first_step >= stop_step:
            return []
        self._check_step(first_step)
        self._check_step(stop_step - 1)
        return self.stream_pieces(self.stream(rank), first_step, stop_step)

    def stream_pieces(self, stream: Stream, first: int, stop: int) -> list[Piece]:
        """The rows of batches ``[first, stop)`` of ``stream`` (a piece's ``step`` counts the
        stream's batches), in batch order, as pieces of row groups. With a shuffle window a
        batch's rows are scattered over its window: a piece per run of consecutive rows (to
        locate rows; :meth:`stream_reads` says how to read them)."""
        out: list[Piece] = []
        for epoch, lo, hi, cuts, step in self._intervals(stream, first, stop):
            if self.shuffle_window_rows is None:
                out += self._interval_pieces(epoch, lo, hi, cuts, step)
                continue
            for read in self._interval_gathers(epoch, lo, hi, cuts, step):
                out += [
                    Piece(r.path, r.row_group, r.start, r.stop, r.file_row, s, counts)
                    for r, s, counts in read.runs()
                ]
        return out

    def stream_reads(self, stream: Stream, first: int, stop: int) -> list[Read]:
        """How to read batches ``[first, stop)`` of ``stream``, in batch order: pieces of row
        groups, or with a shuffle window one gather per window (at most that many rows)."""
        if self.shuffle_window_rows is None:
            return list(self.stream_pieces(stream, first, stop))
        out: list[Read] = []
        for interval in self._intervals(stream, first, stop):
            out += self._interval_gathers(*interval)
        return out

    def _intervals(
        self, stream: Stream, first: int, stop: int
    ) -> list[tuple[int, int, int, np.ndarray, int]]:
        """Batches ``[first, stop)`` of ``stream`` as ``(epoch, lo, hi, cuts, step)``: rows
        ``[lo, hi)`` of the epoch's row space, where batch ``step``, ``step + 1``, ... start in
        it (``cuts``, and where the last one ends)."""
        out: list[tuple[int, int, int, np.ndarray, int]] = []
        at = 0  # the stream's batch where the part starts
        for part in stream:
            lo, hi = max(first, at), min(stop, at + part.count)
            if lo < hi:
                self._check_epoch(part.epoch)
                out += self._part_intervals(part, lo - at, hi - at, step0=at)
            at += part.count
        if stop > at:
            raise ValueError(f"the stream has {at} batches, asked for batches up to {stop}")
        return out

    def _part_intervals(
        self, part: Part, k0: int, k1: int, *, step0: int
    ) -> list[tuple[int, int, int, np.ndarray, int]]:
        """The part's batches ``[k0, k1)`` as intervals of the epoch's row space (``step0``: the
        stream's batch of the part's first)."""
        # Where each batch starts in the part's runs laid end to end; the last: where k1 - 1 ends.
        cuts = part.local_cuts(k0, k1)
        out: list[tuple[int, int, int, np.ndarray, int]] = []
        run_at = 0  # where the run starts in the runs laid end to end
        for run_lo, run_hi in part.runs:
            run_end = run_at + (run_hi - run_lo)
            a, b = max(run_at, int(cuts[0])), min(run_end, int(cuts[-1]))
            if a < b:
                # The batches with rows in [a, b), and their starts moved to the epoch's rows.
                i = int(np.searchsorted(cuts, a, side="right")) - 1
                j = int(np.searchsorted(cuts, b - 1, side="right")) - 1
                shift = run_lo - run_at
                out.append(
                    (part.epoch, a + shift, b + shift, cuts[i : j + 2] + shift, step0 + k0 + i)
                )
            run_at = run_end
        return out

    def _interval_gathers(
        self, epoch: int, lo: int, hi: int, cuts: np.ndarray, step: int
    ) -> list[Gather]:
        """Rows ``[lo, hi)`` of ``epoch``'s row space (``cuts``, ``step``: as for
        :meth:`_interval_pieces`) as one gather per window they meet."""
        assert self.shuffle_window_rows is not None
        w = self.shuffle_window_rows
        order, ends = self._order(epoch)
        out: list[Gather] = []
        while lo < hi:
            k = lo // w
            stop = min(hi, (k + 1) * w)
            rows = self.window_rows(epoch, lo, stop)
            first = int(np.searchsorted(cuts, lo, side="right")) - 1
            last = int(np.searchsorted(cuts, stop - 1, side="right")) - 1
            counts = np.diff(np.clip(cuts[first : last + 2], lo, stop))
            out.append(
                gather(
                    rows,
                    order=order,
                    ends=ends,
                    unit_rows=self._unit_rows,
                    where=self._unit_where,
                    paths=self.paths,
                    step=step + first,
                    counts=counts.tolist(),
                )
            )
            lo = stop
        return out

    def window_rows(self, epoch: int, lo: int, hi: int) -> np.ndarray:
        """The rows (of the epoch's row space before the window shuffle) at places
        ``[lo, hi)``: the places themselves without a shuffle window."""
        self._check_epoch(epoch)
        if self.shuffle_window_rows is None:
            return np.arange(lo, hi, dtype=np.int64)
        w = self.shuffle_window_rows
        parts = []
        while lo < hi:
            k = lo // w
            stop = min(hi, (k + 1) * w)
            parts.append(self._window(epoch, k)[lo - k * w : stop - k * w] + k * w)
            lo = stop
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _window(self, epoch: int, k: int) -> np.ndarray:
        """Window ``k``'s permutation of its rows in ``epoch``."""
        hit = self._windows.get((epoch, k))
        if hit is not None:
            return hit
        assert self.shuffle_window_rows is not None and self.shuffle_seed is not None
        w = self.shuffle_window_rows
        size = min(w, self.rows_per_epoch - k * w)
        perm = window_permutation(self.shuffle_seed, epoch, k, size)
        if len(self._windows) >= _CACHED_WINDOWS:
            self._windows.pop(next(iter(self._windows)))
        self._windows[(epoch, k)] = perm
        return perm

    def _interval_pieces(
        self, epoch: int, lo: int, hi: int, cuts: np.ndarray, step: int
    ) -> list[Piece]:
        """Rows ``[lo, hi)`` of ``epoch``'s row space as pieces of row groups; ``cuts``: where
        batch ``step``, ``step + 1``, ... start (and the last one ends) in that row space."""
        files, groups, file_starts = self._unit_where
        order, ends = self._order(epoch)
        out: list[Piece] = []
        k = int(np.searchsorted(ends, lo, side="right"))
        while lo < hi:
            unit = int(order[k])
            stop = min(hi, int(ends[k]))
            k += 1
            if stop == lo:  # a row group with no rows
                continue
            unit_start = int(ends[k - 1]) - int(self._unit_rows[unit])
            first = int(np.searchsorted(cuts, lo, side="right")) - 1
            last = int(np.searchsorted(cuts, stop - 1, side="right")) - 1
            bounds = np.clip(cuts[first : last + 2], lo, stop)
            out.append(
                Piece(
                    path=self.paths[int(files[unit])],
                    row_group=int(groups[unit]),
                    start=lo - unit_start,
                    stop=stop - unit_start,
                    file_row=int(file_starts[unit]) + lo - unit_start,
                    step=step + first,
                    counts=tuple(int(c) for c in np.diff(bounds)),
                )
            )
            lo = stop
        return out

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's row-group order and the cumulative row count at the end of each."""
        self._check_epoch(epoch)
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

    def _check_epoch(self, epoch: int) -> None:
        if not 0 <= epoch < self.epochs:
            raise ValueError(f"epoch must be in [0, {self.epochs}), got {epoch!r}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_shards:
            raise ValueError(f"rank must be in [0, {self.num_shards}), got {rank!r}")

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must be in [0, {self.num_steps}), got {step!r}")
