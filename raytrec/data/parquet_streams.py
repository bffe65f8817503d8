"""A rank's batches as a :data:`Stream`: parts of epochs' row spaces, each cut into nearly equal
batches (pure: numpy only).

A rank that reads the plan of :mod:`raytrec.data.parquet_plan` from the start has one part per
epoch (its share); after a membership change the rows left are dealt out again
(:mod:`raytrec.data.parquet_recut`) as parts that may span several runs of the row space. Streams
travel in checkpoints and between processes as JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Part",
    "Stream",
    "remaining_rows",
    "stream_batch_size",
    "stream_epoch",
    "stream_length",
    "streams_from_json",
    "streams_to_json",
    "truncated",
]


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


def truncated(stream: Stream, k: int) -> Stream:
    """The first ``k`` batches of ``stream`` (each batch the same rows as in ``stream``)."""
    out: list[Part] = []
    for part in stream:
        if k <= 0:
            break
        out.append(dataclasses.replace(part, count=min(part.count, k)))
        k -= part.count
    return tuple(out)
