"""Where the rows of a growing source's committed batches are (pure: no files read).

A growing source's table of streams (``Result.reshared_streams``, or ``streams_table`` in a
checkpoint's accounting) names its files in the order found, with their row groups, and every
stream the job read; a committed batch id ``(stream, k)`` is then rows of those files. The
ledger counts the rows committed per file from it, and an exactly-once check reads the
``row_id`` of each (:func:`raytrec.testing.committed_row_ids`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from raytrec.data.parquet_plan import BatchPlan, Piece
from raytrec.data.parquet_streams import streams_from_json
from raytrec.data.synthetic import split_batch_id

__all__ = ["committed_pieces", "rows_per_file"]


def committed_pieces(
    table: Mapping[str, Any],
    committed: Sequence[tuple[int, int]],
    *,
    batch_size: int,
    limit: int,
) -> Iterator[Piece]:
    """The rows of every batch in ``committed`` (ranges of batch ids, a range twice for a batch
    committed twice), as pieces of row groups. ``table``: a growing source's (it has
    ``files``); ``limit``: the job's ``num_steps`` (the initial ranks' share of the plan)."""
    files = table["files"]
    plan = BatchPlan(
        paths=tuple(files["paths"]),
        row_groups=tuple(tuple(int(n) for n in g) for g in files["row_groups"]),
        num_shards=int(table["num_shards"]),
        batch_size=batch_size,
        epochs=1,
    )
    made = streams_from_json(table["made"])
    for a, b in committed:
        for batch in range(a, b):
            sid, k = split_batch_id(batch)
            stream = made[sid] if sid in made else plan.stream(sid, limit=limit)
            yield from plan.stream_pieces(stream, k, k + 1)


def rows_per_file(
    table: Mapping[str, Any],
    committed: Sequence[tuple[int, int]],
    *,
    batch_size: int,
    limit: int,
) -> dict[str, int]:
    """Rows committed per file (with multiplicity), every file of the table named."""
    counts: collections.Counter[str] = collections.Counter({p: 0 for p in table["files"]["paths"]})
    for piece in committed_pieces(table, committed, batch_size=batch_size, limit=limit):
        counts[piece.path] += piece.rows
    return dict(counts)
