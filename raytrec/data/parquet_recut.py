"""Sharing the rows left to train among a new membership's ranks (pure: numpy only).

:func:`recut` deals every remaining row out again, one new stream per rank; :func:`hand_off`
gives joining ranks the ends of the survivors' streams and cuts those short, so survivors go
on reading their own. Both keep ranks in lockstep: every rank has the same number of batches
left, and every row of every epoch is trained once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from raytrec.data.parquet_streams import (
    Part,
    Stream,
    remaining_rows,
    stream_length,
    truncated,
)

__all__ = ["Handoff", "Recut", "TakeOver", "hand_off", "recut", "take_over"]


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TakeOver:
    """:func:`take_over`'s answer. ``streams[i]``: survivor ``i``'s stream, longer (its batches
    before ``keep[i]`` are unchanged, so the survivor goes on reading them); every survivor has
    ``batches`` batches to train from now (replays counted)."""

    streams: tuple[Stream, ...]
    keep: tuple[int, ...]
    batches: int


def take_over(
    survivors: Sequence[tuple[Stream, int, int]],
    orphaned: Mapping[int, Sequence[tuple[int, int]]],
    *,
    batch_size: int,
) -> TakeOver | None:
    """Shares the rows a loss left without a rank (``orphaned``: epoch -> ranges) among the
    survivors without closing their streams.

    ``survivors[i]``: (stream, the next batch the survivor reads in it, replays queued ahead of
    it). Where :func:`recut` deals every row left out again (and every survivor opens a new
    stream, whose data pipeline delivers nothing for seconds), here each survivor reads on to
    the end of the part of its stream it is in (``keep[i]``: the rest of its current epoch,
    which its pipeline is already reading); every row after those (the survivors' later parts
    and the orphaned rows) is cut by :func:`recut` as if those kept batches were queued, and
    appended to the survivor's stream. So epochs stay in order, every survivor ends at the same
    step, and the pipeline of the appended part has the kept batches' time to start.

    None when this cannot be done: the rows after the kept batches cannot even them out (a
    :func:`recut` with rows left over, or survivors with different numbers of batches left).
    """
    if not survivors:
        return None
    keep, queued = [], []
    remaining: dict[int, list[tuple[int, int]]] = {}
    for stream, at, q in survivors:
        end = _part_end(stream, at)
        keep.append(end)
        queued.append(q + end - at)
        for epoch, runs in remaining_rows(stream, end).items():
            remaining.setdefault(epoch, []).extend(runs)
    for epoch, rows in orphaned.items():
        remaining.setdefault(epoch, []).extend(rows)
    shared = recut(remaining, queued=queued, batch_size=batch_size)
    left = {q + stream_length(s) for q, s in zip(queued, shared.streams, strict=True)}
    if shared.left_over or len(left) != 1:
        return None
    streams = tuple(
        truncated(stream, end) + new
        for (stream, _, _), end, new in zip(survivors, keep, shared.streams, strict=True)
    )
    return TakeOver(streams=streams, keep=tuple(keep), batches=left.pop())


def _part_end(stream: Stream, k: int) -> int:
    """Where the part of ``stream`` holding batch ``k`` ends (the stream's end from there on)."""
    at = 0
    for part in stream:
        at += part.count
        if k < at:
            return at
    return at


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
