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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from raytrec.data.parquet_gather import Gather, gather, window_permutation

__all__ = [
    "BatchPlan",
    "Handoff",
    "Part",
    "Piece",
    "Read",
    "Recut",
    "Stream",
    "hand_off",
    "recut",
    "remaining_rows",
    "stream_batch_size",
    "stream_epoch",
    "stream_length",
    "streams_from_json",
    "streams_to_json",
    "truncated",
]

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """The first ``count`` batches of ``runs`` (ranges of epoch ``epoch``'s row space, ``total``
    rows laid end to end) cut into ``cut`` nearly equal batches: batch ``j`` is rows
    ``[j*total//cut, (j+1)*total//cut)`` of the runs. A rank's share of an epoch is one part of
    one run; rows re-shared among the ranks after a membership change may span several runs."""

    epoch: int
    runs: tuple[tuple[int, int], ...]
    total: int
    cut: int
    count: int

    def local_cuts(self, k0: int, k1: int) -> np.ndarray:
        """Where the part's batches ``k0 .. k1 - 1`` start in ``runs`` laid end to end, and
        where the last one ends."""
        j = np.arange(k0, k1 + 1, dtype=np.int64)
        return j * self.total // self.cut

    def size_of(self, k: int) -> int:
        """Rows of the part's batch ``k``."""
        a, b = self.local_cuts(k, k + 1)
        return int(b - a)

    def runs_from(self, k: int) -> list[tuple[int, int]]:
        """The rows of the part's batches from ``k`` on, as ranges of the epoch's row space."""
        if k >= self.count:
            return []
        start, stop = (int(c) for c in self.local_cuts(k, self.count)[[0, -1]])
        out: list[tuple[int, int]] = []
        at = 0
        for lo, hi in self.runs:
            end = at + hi - lo
            a, b = max(start, at), min(stop, end)
            if a < b:
                out.append((lo + a - at, lo + b - at))
            at = end
        return out

    def to_json(self) -> list[Any]:
        runs = [list(r) for r in self.runs]
        return [self.epoch, runs, self.total, self.cut, self.count]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> Part:
        epoch, runs, total, cut, count = value
        return cls(
            epoch=int(epoch),
            runs=tuple((int(a), int(b)) for a, b in runs),
            total=int(total),
            cut=int(cut),
            count=int(count),
        )


#: What a rank reads for a run of its batches: rows of one row group, or a window's gather.
Read = Piece | Gather

# What one rank reads, in order: parts of epochs, never two parts of one epoch out of order.
Stream = tuple[Part, ...]


def streams_to_json(streams: Mapping[int, Stream]) -> dict[str, list[list[Any]]]:
    return {str(sid): [p.to_json() for p in s] for sid, s in streams.items()}


def streams_from_json(value: Mapping[str, Sequence[Any]]) -> dict[int, Stream]:
    return {int(sid): tuple(Part.from_json(p) for p in parts) for sid, parts in value.items()}


def stream_length(stream: Stream) -> int:
    return sum(p.count for p in stream)


def stream_batch_size(stream: Stream, k: int) -> int:
    """Rows of batch ``k`` of ``stream``."""
    part, j = _locate(stream, k)
    return part.size_of(j)


def stream_epoch(stream: Stream, k: int) -> int:
    return _locate(stream, k)[0].epoch


def remaining_rows(stream: Stream, k: int) -> dict[int, list[tuple[int, int]]]:
    """Epoch -> the rows (ranges of its row space) of ``stream``'s batches from ``k`` on."""
    out: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for part in stream:
        if at + part.count > k:
            runs = part.runs_from(max(k - at, 0))
            if runs:
                out.setdefault(part.epoch, []).extend(runs)
        at += part.count
    return out


def _locate(stream: Stream, k: int) -> tuple[Part, int]:
    at = 0
    for part in stream:
        if k < at + part.count:
            return part, k - at
        at += part.count
    raise ValueError(f"the stream has {at} batches, batch {k} is not one of them")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recut:
    """:func:`recut`'s answer: one stream per rank (each as many batches long, counting the
    batches queued ahead of it), and the rows it could not give out (``left_over``: an epoch
    whose remaining rows are fewer than the ranks need to fill a batch each)."""

    streams: tuple[Stream, ...]
    left_over: int


def recut(
    remaining: Mapping[int, Sequence[tuple[int, int]]],
    *,
    queued: Sequence[int],
    batch_size: int,
) -> Recut:
    """Splits the rows left to train among ``len(queued)`` ranks (a membership change).

    ``remaining``: epoch -> rows of its row space no rank has trained (and none will, unless
    given out here). ``queued[i]``: batches rank ``i`` must train before its new stream (replays
    of a lost gang's uncommitted batches). Epoch by epoch, in order, the rows (sorted by their
    place in the epoch, so a rank's reads stay local) are cut into nearly equal batches of at
    most ``batch_size`` rows: ``C`` batches in all, ``c_i`` of them rank ``i``'s. Rank ``i``
    takes the consecutive rows ``[P_i*n//C, P_{i+1}*n//C)`` (``P_i``: the batches of the ranks
    before it) and cuts them into its ``c_i`` batches. In the first epoch with rows,
    ``c_i = K - queued[i]``, so that every rank has the same ``K`` batches to train before the
    next epoch; later epochs give every rank the same count. So ranks that train in lockstep
    all finish the data at the same step; and a whole epoch among ranks that queue nothing is
    cut exactly as :class:`BatchPlan` cuts it.
    """
    ranks = len(queued)
    if ranks < 1:
        raise ValueError("recut needs at least one rank")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    streams: list[list[Part]] = [[] for _ in range(ranks)]
    extra = list(queued)
    left_over = 0
    for epoch in sorted(remaining):
        runs = _merged(remaining[epoch])
        n = sum(b - a for a, b in runs)
        if n == 0:
            continue
        need = -(-n // batch_size)  # batches of at most batch_size rows
        k = max(max(extra), -(-(need + sum(extra)) // ranks))
        counts = [k - q for q in extra]
        cut = sum(counts)
        if cut > n:  # fewer rows than batches: some batch would be empty
            left_over += n
            continue
        extra = [0] * ranks
        ends = np.cumsum([b - a for a, b in runs])
        first = 0
        for i, count in enumerate(counts):
            if count:
                lo, hi = first * n // cut, (first + count) * n // cut
                streams[i].append(
                    Part(
                        epoch=epoch,
                        runs=_slice_runs(runs, ends, lo, hi),
                        total=hi - lo,
                        cut=count,
                        count=count,
                    )
                )
            first += count
    return Recut(streams=tuple(tuple(s) for s in streams), left_over=left_over)


def _merged(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in runs if b > a):
        if out and a < out[-1][1]:
            raise ValueError(f"rows {a}..{b} given out twice (they overlap {out[-1]})")
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _slice_runs(
    runs: Sequence[tuple[int, int]], ends: np.ndarray, lo: int, hi: int
) -> tuple[tuple[int, int], ...]:
    """Rows ``[lo, hi)`` of ``runs`` laid end to end, as ranges of the row space."""
    out: list[tuple[int, int]] = []
    i = int(np.searchsorted(ends, lo, side="right"))
    while lo < hi:
        run_lo, run_hi = runs[i]
        start = int(ends[i]) - (run_hi - run_lo)
        a, b = run_lo + lo - start, run_lo + min(hi, int(ends[i])) - start
        out.append((a, b))
        lo = min(hi, int(ends[i]))
        i += 1
    return tuple(out)


def truncated(stream: Stream, k: int) -> Stream:
    """The first ``k`` batches of ``stream`` (each batch the same rows as in ``stream``)."""
    out: list[Part] = []
    for part in stream:
        if k <= 0:
            break
        out.append(dataclasses.replace(part, count=min(part.count, k)))
        k -= part.count
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Handoff:
    """:func:`hand_off`'s answer. ``kept[i]``: survivor ``i``'s stream, cut short (its first
    batches are unchanged, so the survivor goes on reading it); ``streams[j]``: joining rank
    ``j``'s new stream; every rank has ``batches`` batches to train from now (replays counted);
    ``rows``: the rows handed to the joining ranks."""

    kept: tuple[Stream, ...]
    streams: tuple[Stream, ...]
    batches: int
    rows: int


def hand_off(
    survivors: Sequence[tuple[Stream, int, int]], *, joining: int, batch_size: int
) -> Handoff | None:
    """Shares the rows left with ``joining`` new ranks by cutting the survivors' streams short.

    ``survivors[i]``: (stream, the next batch the survivor reads in it, replays queued ahead of
    it). Where :func:`recut` deals every row out again (and every rank then opens a new stream),
    here each survivor keeps reading its own stream and trains only its first ``K`` batches
    from now (replays counted); the rows of the survivors' batches beyond that go to the joining
    ranks, cut into exactly ``K`` batches each of at most ``batch_size`` rows, epoch by epoch.
    So every rank finishes the data at the same step, and a survivor's data pipeline goes on
    undisturbed. The rows a joining rank gets come from the ends of the survivors' streams, of
    later epochs when those streams span several: epochs overlap after a join, and every row of
    every epoch is still trained once.

    ``K`` is the smallest count for which the rows handed off fit. None when this cannot be
    done: survivors with different numbers of batches left, or too few rows left to give every
    joining rank as many batches as the survivors keep.
    """
    if joining < 1 or not survivors:
        return None
    left = {q + stream_length(s) - at for s, at, q in survivors}
    if len(left) != 1:
        return None
    (total,) = left
    low = max(
        max(q for _, _, q in survivors), -(-len(survivors) * total // (len(survivors) + joining))
    )
    for k in range(max(low, 1), total):
        tails: dict[int, list[tuple[int, int]]] = {}
        for s, at, q in survivors:
            for epoch, runs in remaining_rows(s, at + k - q).items():
                tails.setdefault(epoch, []).extend(runs)
        rows = sum(b - a for runs in tails.values() for a, b in runs)
        if rows < joining * k:
            return None  # a larger k only hands off fewer rows
        streams = _cut_exactly(tails, ranks=joining, batches=k, batch_size=batch_size)
        if streams is not None:
            kept = tuple(truncated(s, at + k - q) for s, at, q in survivors)
            return Handoff(kept=kept, streams=streams, batches=k, rows=rows)
    return None


def _cut_exactly(
    rows: Mapping[int, Sequence[tuple[int, int]]], *, ranks: int, batches: int, batch_size: int
) -> tuple[Stream, ...] | None:
    """``rows`` (epoch -> ranges) cut into ``ranks * batches`` batches of 1 to ``batch_size``
    rows, epoch by epoch in order; rank ``i`` takes batches ``i*batches .. (i+1)*batches - 1``.
    None when they do not fit."""
    epochs = [(e, _merged(rows[e])) for e in sorted(rows)]
    epochs = [(e, runs) for e, runs in epochs if runs]
    sizes = [sum(b - a for a, b in runs) for _, runs in epochs]
    want = ranks * batches
    counts = [-(-n // batch_size) for n in sizes]  # the fewest batches each epoch needs
    if sum(counts) > want or sum(sizes) < want:
        return None
    for i, n in enumerate(sizes):  # the other batches, to the epochs in order, as rows allow
        more = min(n - counts[i], want - sum(counts))
        counts[i] += more
    streams: list[list[Part]] = [[] for _ in range(ranks)]
    first = 0  # the job-wide index of the epoch's first batch
    for (epoch, runs), n, cut in zip(epochs, sizes, counts, strict=True):
        ends = np.cumsum([b - a for a, b in runs])
        for i in range(ranks):
            j0 = max(i * batches, first) - first
            j1 = min((i + 1) * batches, first + cut) - first
            if j1 <= j0:
                continue
            lo, hi = j0 * n // cut, j1 * n // cut
            if not j1 - j0 <= hi - lo <= (j1 - j0) * batch_size:
                return None
            part = Part(
                epoch=epoch,
                runs=_slice_runs(runs, ends, lo, hi),
                total=hi - lo,
                cut=j1 - j0,
                count=j1 - j0,
            )
            streams[i].append(part)
        first += cut
    return tuple(tuple(s) for s in streams)


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
