"""Sets of row ids as sorted, merged half-open ranges ``[start, stop)``.

An epoch's rows are the ids ``0 .. N-1``; what a gang read is usually a few long runs, so sets
of ids are kept as runs, O(runs) in memory and time, never O(rows). :func:`split_balanced`
divides a set among k receivers with row counts that differ by at most one, cutting at most
k - 1 runs (every other run goes whole to one receiver). :func:`layered` writes a multiset of
ranges compactly without losing how often an id occurs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["RowRanges", "coverage", "layered", "split_balanced"]

Range = tuple[int, int]


def _normalize(ranges: Iterable[Range]) -> tuple[Range, ...]:
    items = []
    for r in ranges:
        start, stop = int(r[0]), int(r[1])
        if start < 0 or stop < start:
            raise ValueError(f"row range [{start}, {stop}) must have 0 <= start <= stop")
        if stop > start:
            items.append((start, stop))
    items.sort()
    merged: list[list[int]] = []
    for start, stop in items:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return tuple((a, b) for a, b in merged)


@dataclasses.dataclass(frozen=True)
class RowRanges:
    """An immutable set of non-negative row ids, as merged ranges."""

    ranges: tuple[Range, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", _normalize(self.ranges))

    @classmethod
    def of(cls, *ranges: Range) -> RowRanges:
        return cls(tuple(ranges))

    @classmethod
    def from_ids(cls, ids: Iterable[int]) -> RowRanges:
        return cls(tuple((i, i + 1) for i in ids))

    @property
    def count(self) -> int:
        """How many ids the set holds."""
        return sum(b - a for a, b in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __iter__(self) -> Iterator[int]:
        for a, b in self.ranges:
            yield from range(a, b)

    def __contains__(self, row: object) -> bool:
        return isinstance(row, int) and any(a <= row < b for a, b in self.ranges)

    def union(self, *others: RowRanges) -> RowRanges:
        return RowRanges(self.ranges + tuple(r for o in others for r in o.ranges))

    def difference(self, other: RowRanges) -> RowRanges:
        """Ids in ``self`` and not in ``other`` (one merge pass over both)."""
        out: list[Range] = []
        cut = other.ranges
        j = 0
        for a, b in self.ranges:
            while j < len(cut) and cut[j][1] <= a:
                j += 1
            k, start = j, a
            while k < len(cut) and cut[k][0] < b:
                if cut[k][0] > start:
                    out.append((start, cut[k][0]))
                start = max(start, cut[k][1])
                k += 1
            if start < b:
                out.append((start, b))
        return RowRanges(tuple(out))

    def __repr__(self) -> str:
        return f"RowRanges({list(self.ranges)})"


def coverage(ranges: Iterable[Range], *, total: int) -> tuple[RowRanges, RowRanges]:
    """For ranges that may repeat or overlap: ``(missing, duplicated)`` ids of ``0..total-1``;
    missing = covered by no range, duplicated = covered by two or more (ids past ``total``
    count as duplicated if repeated, and are otherwise ignored)."""
    deltas: dict[int, int] = {}
    for a, b in ranges:
        if b > a:
            deltas[a] = deltas.get(a, 0) + 1
            deltas[b] = deltas.get(b, 0) - 1
    deltas.setdefault(0, 0)
    deltas.setdefault(total, 0)
    missing: list[Range] = []
    doubled: list[Range] = []
    depth = 0
    points = sorted(deltas)
    for here, nxt in itertools.pairwise(points):
        depth += deltas[here]
        if depth == 0 and here < total:
            missing.append((here, min(nxt, total)))
        elif depth >= 2:
            doubled.append((here, nxt))
    return RowRanges(tuple(missing)), RowRanges(tuple(doubled))


def split_balanced(
    items: Sequence[tuple[int, Range]], parts: int
) -> tuple[tuple[tuple[int, Range], ...], ...]:
    """Splits keyed ranges (e.g. ``(epoch, range)``) into ``parts`` shares in the given order.

    Share i gets ``total // parts`` rows, plus one for the first ``total % parts`` shares. Ranges
    are handed out in order and cut only where a share is full, so at most ``parts - 1`` ranges
    are cut and every share is a contiguous stretch of the input.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    total = sum(b - a for _, (a, b) in items)
    quotas = [total // parts + (1 if i < total % parts else 0) for i in range(parts)]
    shares: list[list[tuple[int, Range]]] = [[] for _ in range(parts)]
    i = 0
    for key, (a, b) in items:
        while a < b:
            while quotas[i] == 0:
                i += 1
            take = min(b - a, quotas[i])
            shares[i].append((key, (a, a + take)))
            quotas[i] -= take
            a += take
    return tuple(tuple(s) for s in shares)


def layered(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """The same multiset of ids as ``ranges``, as few ranges as the multiplicities allow.

    Layer ``j`` holds the ids covered at least ``j`` times, merged: ids covered once everywhere
    (the exactly-once case) come out as one merged set, and an id covered twice is in two layers,
    so a duplicate survives a round trip (a plain merge would hide it).
    """
    deltas: dict[int, int] = {}
    for a, b in ranges:
        if b > a:
            deltas[a] = deltas.get(a, 0) + 1
            deltas[b] = deltas.get(b, 0) - 1
    layers: list[list[Range]] = []
    depth = 0
    for here, nxt in itertools.pairwise(sorted(deltas)):
        depth += deltas[here]
        while len(layers) < depth:
            layers.append([])
        for j in range(depth):
            layer = layers[j]
            if layer and layer[-1][1] == here:
                layer[-1] = (layer[-1][0], nxt)
            else:
                layer.append((here, nxt))
    return tuple(r for layer in layers for r in layer)
